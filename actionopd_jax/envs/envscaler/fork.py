"""Forks of a live EnvScaler episode (envs/fork.py): each fork is a new instance of the
scenario's class in its own sandboxed process (`Sandbox.open_class`, the same sandbox, limits and
call timeout as the episode), built from a copy of the live instance's public state.

A copy is faithful only if the class keeps all its state in public attributes that survive JSON
(the class session's `state()`; `open_class` sets them back on the new instance). The fork
checks this before every call: a fork whose state does not read back equal to the copy (a set,
a datetime or a private attribute the constructor rebuilt differently) is a fork error, so the
pair goes to the judge instead of being decided on a state that is not the episode's.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable

from actionopd_jax.envs.fork import ForkResult, ToolEffects, fork_workdir_parent
from actionopd_jax.envs.sandbox import Sandbox, SandboxError
from actionopd_jax.envs.tool_args import check_tool_call
from actionopd_jax.types import ToolCall


class ClassForkPoint:
    """The state of one EnvScaler episode at one decision point. `before`: the live instance's
    public state when the matcher asked; `run(call)` opens a fork from it, checks the copy,
    runs the call there and reads the state back; the fork's process always ends."""

    def __init__(self, sandbox: Sandbox, code: str, class_name: str, before: dict[str, Any], tools: list,
                 effects: Callable[[str], ToolEffects], *, timeout_s: float, run_off_loop: Callable):
        self.sandbox, self.code, self.class_name = sandbox, code, class_name
        self.before, self.tools, self._effects = before, tools, effects
        self.timeout_s = timeout_s
        self._off_loop = run_off_loop

    def effects(self, tool: str) -> ToolEffects:
        return self._effects(tool)

    async def run(self, call: ToolCall) -> ForkResult:
        t0 = time.perf_counter()
        try:
            return await self._off_loop(self._run_blocking, call, t0)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a fork's failure is "cannot settle", never the episode's
            return ForkResult(error=f"fork failed: {type(err).__name__}: {err}", wall_s=time.perf_counter() - t0)

    def _run_blocking(self, call: ToolCall, t0: float) -> ForkResult:
        problem = check_tool_call(call, self.tools, check_types=False)
        if problem is not None:  # the episode would answer the schema error without running anything
            return ForkResult(observation=f"Error: {problem}", state=self.before, wall_s=time.perf_counter() - t0)
        try:
            session = self.sandbox.open_class(self.code, self.class_name, self.before, timeout_s=self.timeout_s,
                                              **self._where())
        except SandboxError as err:
            return ForkResult(error=f"fork did not start: {err}", wall_s=time.perf_counter() - t0)
        try:
            if session.state() != self.before:
                return ForkResult(error="the state does not copy faithfully (it does not read back equal)",
                                  wall_s=time.perf_counter() - t0)
            try:
                text = session.call(call.name, call.arguments)
            except SandboxError as err:
                if err.fatal:
                    return ForkResult(error=f"fork process failed: {err}", wall_s=time.perf_counter() - t0)
                text = f"Error: {err}"  # the method raised: what the episode shows the agent
            return ForkResult(observation=text, state=session.state(), wall_s=time.perf_counter() - t0)
        except SandboxError as err:
            return ForkResult(error=f"fork process failed: {err}", wall_s=time.perf_counter() - t0)
        finally:
            session.close()

    def _where(self) -> dict[str, Any]:
        """The fork's directory under this process's sweepable fork root (envs/fork.py), where
        the sandbox lets us choose it."""
        try:
            params = inspect.signature(self.sandbox.open_class).parameters
        except (TypeError, ValueError):
            return {}
        return {"workdir_parent": str(fork_workdir_parent())} if "workdir_parent" in params else {}

    def close(self) -> None:
        """Nothing to release: every fork's process ends with its call."""
