"""Forks of a live BFCL episode (envs/fork.py) for the matcher's execution stage: the episode's
class instances are plain Python objects in this process (bfcl_exec.BFCLInstances, run there
by the episode's own steps too), so a fork is a deep copy of them, taken once at the decision
point and copied again for each call, which runs through the same checks as an episode step.

The state compared is a structural snapshot of the instances: every attribute, recursively,
with sets sorted, tuples tagged, a back-reference to an enclosing object (a directory's parent)
written as a marker, a random generator by its internal state and a date or time as one tagged
string, so that two forks compare equal exactly when their instances hold the same values.

Effects per tool (`bfcl_effects`), from the class that owns the tool: GorillaFileSystem stamps a
file with `datetime.now()` whenever a call creates or writes it (`File._last_modified`; the
package's own `File.__eq__` leaves it out), so that field is volatile for its tools: a fresh
stamp is masked, an old one still compared. WebSearchAPI's tools fetch live web pages (requests):
external, never run on a fork. The other classes draw ids and values from a seeded generator
that is part of the copied state, so their effects reproduce exactly.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import random
import time
from typing import Any

from actionopd_jax.envs.fork import ForkResult, ToolEffects
from actionopd_jax.envs.tool_args import check_tool_call
from actionopd_jax.types import ToolCall

_MAX_DEPTH = 64


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()


def snapshot(value: Any, _stack: frozenset[int] = frozenset(), _depth: int = 0) -> Any:
    """A JSON-comparable picture of `value` (see the module docstring)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if _depth > _MAX_DEPTH:
        raise ValueError("state nested too deep to compare")
    if id(value) in _stack:
        return {"<back-reference>": type(value).__name__}
    inner = _stack | {id(value)}
    if isinstance(value, dict):
        return {"<dict>": [[snapshot(k, inner, _depth + 1), snapshot(v, inner, _depth + 1)] for k, v in value.items()]}
    if isinstance(value, list):
        return [snapshot(v, inner, _depth + 1) for v in value]
    if isinstance(value, tuple):
        return {"<tuple>": [snapshot(v, inner, _depth + 1) for v in value]}
    if isinstance(value, (set, frozenset)):
        items = [snapshot(v, inner, _depth + 1) for v in value]
        return {"<set>": sorted(items, key=_digest)}
    if isinstance(value, (datetime.date, datetime.time, datetime.timedelta)):
        # one scalar (a tagged string), so that a declared volatile field holding it can be masked
        return f"<{type(value).__name__}>{value.isoformat() if hasattr(value, 'isoformat') else value}"
    if isinstance(value, random.Random):
        return {"<random>": _digest(repr(value.getstate()))}
    if hasattr(value, "__dict__") and not callable(value):
        return {"<object>": type(value).__qualname__,
                "attrs": {k: snapshot(v, inner, _depth + 1) for k, v in sorted(vars(value).items())}}
    return {"<value>": type(value).__qualname__, "repr": repr(value)}


class InstanceForkPoint:
    """The BFCL episode's instances at one decision point. `check(call)` is the episode's own
    refusal rule (schema, executable here, strict types): a refused call is answered as the
    episode would answer it, without running."""

    def __init__(self, instances: Any, check, effects=None):
        self._frozen = copy.deepcopy(instances)
        self._check = check
        self._effects = effects or (lambda tool: ToolEffects())
        self.before = snapshot(self._frozen.instances)

    def effects(self, tool: str) -> ToolEffects:
        return self._effects(tool)

    async def run(self, call: ToolCall) -> ForkResult:
        t0 = time.perf_counter()
        try:
            problem = self._check(call)
            if problem is not None:
                return ForkResult(observation=f"Error during execution: {problem}", state=self.before,
                                  wall_s=time.perf_counter() - t0)
            fork = copy.deepcopy(self._frozen)
            text = fork.execute(call.name, call.arguments)
            return ForkResult(observation=text, state=snapshot(fork.instances), wall_s=time.perf_counter() - t0)
        except Exception as err:  # noqa: BLE001 - a fork's failure is "cannot settle", never the episode's
            return ForkResult(error=f"fork failed: {type(err).__name__}: {err}", wall_s=time.perf_counter() - t0)

    def close(self) -> None:
        self._frozen = None


# bfcl_eval class -> its state fields regenerated on every run (see the module docstring)
VOLATILE_FIELDS = {"GorillaFileSystem": ("_last_modified",)}
EXTERNAL_CLASSES = frozenset({"WebSearchAPI"})


def bfcl_effects(instances: Any):
    """Tool name -> its `ToolEffects`, from the class instance that owns the tool in this
    episode (a later class wins a name clash, as when the episode runs it)."""
    def effects(tool: str) -> ToolEffects:
        owner = instances.methods.get(tool)
        cls = type(owner).__name__ if owner is not None else ""
        return ToolEffects(volatile=VOLATILE_FIELDS.get(cls, ()), external=cls in EXTERNAL_CLASSES)
    return effects


def refusal(tools: list, instances: Any, strict_types: bool):
    """The episode's refusal rule for one call (BFCLEnv._tool_step), as a function."""
    def check(call: ToolCall) -> str | None:
        problem = check_tool_call(call, tools, check_types=False)
        if problem is None and not instances.has_method(call.name):
            problem = f"Tool '{call.name}' cannot be executed in this environment."
        if problem is None and strict_types:
            problem = check_tool_call(call, tools)
        return problem
    return check
