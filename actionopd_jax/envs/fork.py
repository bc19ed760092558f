"""Forks of a live episode's state, for the matcher's execution stage (matching/execution.py).

An environment that can copy its state cheaply offers `fork_point()`: a `ForkPoint` that holds
a copy of the state at the current decision point (taken once, when the matcher asks) and
runs one tool call on a fresh fork of it per `run(call)`, returning what the call showed and
the state it left. Nothing a fork does reaches the live episode: a fork starts from the copy,
never from the episode's own process or file, and is thrown away after the call.

Forks run contained exactly like episode steps: the same sandbox, with the same limits and call
timeout (EnvScaler: `Sandbox.open_class`, one process per fork). A fork that fails (the process
died, timed out, the call raised, the state did not copy faithfully) returns a result with
`error` set, which the execution stage reads as "cannot settle" (the judge decides); it never
raises into the episode and never ends it.

Each tool may declare its effects in the task payload's `tool_effects`:
`{"tool": {"volatile": ["id", "created_at"], "external": true}}`. Volatile fields are values the
tool generates afresh on every run (ids, timestamps): the comparison masks the values that
appear under those keys and were not in the state before the call. An external tool (it sends
mail, calls out) is never run on a fork.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from actionopd_jax.envs.scratch import pid_alive
from actionopd_jax.types import Task, ToolCall


# Environments whose episodes offer `fork_point()` (the matcher's execution stage acts there);
# the rest are decided by the rules and the judge as before.
FORKABLE_ENVS = ("envscaler", "bfcl", "awm")
NOT_FORKABLE_WHY = {
    "tau2": "not built yet (its domain database could be deep-copied)",
    "mcp": "a generic MCP server's state is not ours to copy",
}


def execution_support(pools: list[str]) -> list[str]:
    """One line per pool (environment name) of the run: whether the execution stage forks it."""
    out = []
    for pool in pools:
        family = "tau2" if pool.startswith("tau2") else pool
        if family in FORKABLE_ENVS:
            out.append(f"{pool}: forks (matcher.execution acts)")
        else:
            out.append(f"{pool}: no forks, rules then judge ({NOT_FORKABLE_WHY.get(family, 'not forkable')})")
    return out


FORK_ROOT_NAME = "actionopd-forks"
_fork_dir_lock = threading.Lock()
_fork_dir: dict[str, Path] = {}


def fork_workdir_parent(root: str | Path | None = None) -> Path:
    """This process's directory for its forks' private directories, `<tmp>/actionopd-forks/<pid>`.
    Made once per process; making it first removes the directories of processes that are gone
    (a trainer killed with -9 leaves its forks' directories behind: their processes die with it,
    the launcher's parent-death signal, but nothing of theirs removes the files)."""
    base = Path(root) if root is not None else Path(tempfile.gettempdir()) / FORK_ROOT_NAME
    with _fork_dir_lock:
        key = str(base)
        if key not in _fork_dir:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
            for entry in base.iterdir():
                if entry.name.isdigit() and int(entry.name) != os.getpid() and not pid_alive(int(entry.name)):
                    shutil.rmtree(entry, ignore_errors=True)
            mine = base / str(os.getpid())
            mine.mkdir(mode=0o700, exist_ok=True)
            _fork_dir[key] = mine
        return _fork_dir[key]


@dataclass(frozen=True)
class ToolEffects:
    volatile: tuple[str, ...] = ()
    external: bool = False


@dataclass(frozen=True)
class ForkResult:
    """One tool call on one fork. `observation`: the tool message's text; `state`: the state
    after the call (JSON values); `error`: why the fork could not give a usable result ("" when
    it did). A tool that answers "Error: ..." to the agent is a result, not a fork error; the
    execution stage decides what to make of it."""

    observation: str = ""
    state: Any = None
    error: str = ""
    wall_s: float = 0.0


@runtime_checkable
class ForkPoint(Protocol):
    """The state of one episode at one decision point, forkable."""

    before: Any  # the state the forks start from (JSON values)

    def effects(self, tool: str) -> ToolEffects: ...

    async def run(self, call: ToolCall) -> ForkResult: ...

    def close(self) -> None: ...


def tool_effects_of(task: Task | None) -> dict[str, ToolEffects]:
    """The per-tool effect declarations of a task's payload (`tool_effects`), checked: a bad
    declaration is an error naming the task, since a wrong one could hide a real difference."""
    raw = (task.payload or {}).get("tool_effects") if task is not None else None
    if not raw:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"task {task.task_id}: payload tool_effects must map a tool name to "
                         f"{{'volatile': [keys], 'external': bool}}, got {type(raw).__name__}")
    out = {}
    for name, decl in raw.items():
        if not isinstance(decl, dict) or set(decl) - {"volatile", "external"}:
            raise ValueError(f"task {task.task_id}: tool_effects[{name!r}] must be a mapping with keys "
                             f"'volatile' (a list of field names) and/or 'external' (bool), got {decl!r}")
        volatile = decl.get("volatile") or []
        if not isinstance(volatile, list) or not all(isinstance(v, str) and v for v in volatile):
            raise ValueError(f"task {task.task_id}: tool_effects[{name!r}].volatile must be a list of field names")
        out[str(name)] = ToolEffects(volatile=tuple(volatile), external=bool(decl.get("external", False)))
    return out


@dataclass
class FixedEffects:
    """Effect declarations by tool name (tools not named: deterministic, internal)."""

    by_tool: dict[str, ToolEffects] = field(default_factory=dict)

    def __call__(self, tool: str) -> ToolEffects:
        return self.by_tool.get(tool, ToolEffects())
