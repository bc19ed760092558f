"""An AWM task as an `Environment` (`env.name: awm`), on the MCP layer (envs/mcp/env.py).

`reset(task)` leases a server of the task's scenario from the runtime's pool (a running,
reset server: its database is a fresh copy of the scenario's cached initial database) and shows
the system prompt, the task as the user turn, and the tools the server lists. Each `ToolCall`
runs through tools/call; the result is the tool message. The first `Message` (the final
answer) or `Invalid` ends the episode, as in AWM's own runner. A server fault (death, timeout,
garbage) ends the episode with the MCP reason; the server is replaced, other episodes go on.

At the end the episode's database is copied out before the server is reset for the next
episode, and `score()` runs the task's verifier (envs/awm/verify.py) on (initial, final):
code mode, or SQL facts + the run's judge. `reward` is 1.0 on success, else 0.0; `success`,
`verdict` and `verifier_mode` say how it was decided. An episode ended by a fault is not
verified (`verdict: "not_verified"`).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from actionopd_jax.envs.awm.layout import initial_messages
from actionopd_jax.envs.awm.runtime import AwmRuntime
from actionopd_jax.envs.awm.verify import Verdict, verify_code, verify_sql
from actionopd_jax.envs.base import EnvError
from actionopd_jax.envs.mcp.client import McpFault
from actionopd_jax.envs.mcp.env import McpEnv
from actionopd_jax.envs.scratch import scratch_dir
from actionopd_jax.types import Observation, Task


class AwmEnv(McpEnv):
    name = "awm"

    def __init__(self, runtime: AwmRuntime, *, max_tool_calls: int = 40, verifier_timeout_s: float = 30.0):
        super().__init__(pool=None, max_tool_calls=max_tool_calls)  # the pool view is the task's scenario's
        self.runtime = runtime
        self.verifier_timeout_s = verifier_timeout_s
        self._fault = ""
        self._dir: Path | None = None
        self._final: Path | None = None
        self._verdict: Verdict | None = None

    async def reset(self, task: Task) -> Observation:
        if task.env != "awm":
            raise ValueError(f"AwmEnv runs awm tasks, got env {task.env!r} ({task.task_id})")
        if self._server is not None:
            self._give_back(ok=not self._fault)
        self._cleanup()
        self._task, self._done, self._end_reason, self._fault = task, False, "", ""
        self._scenario = self.runtime.scenario(task.payload["scenario"])
        self.pool = self.runtime.view(self._scenario.name)
        self._messages = initial_messages(task)
        self._calls, self._errors, self._tools = 0, 0, []
        self._dir = Path(tempfile.mkdtemp(prefix="awm-episode-", dir=scratch_dir()))
        self._final, self._verdict = None, None
        try:
            self._server = await self.pool.acquire()
        except McpFault as fault:
            self._finish(fault.end_reason, fault=fault.detail)
            raise
        self._tools = list(self._server.tools)
        return self._observation()

    async def fork_point(self):
        """The episode's database as a fork point for the matcher's execution stage
        (envs/awm/fork.py), or None when no episode is running on a server."""
        if self._task is None or self._done or self._server is None or self._dir is None or self._fault:
            return None
        import asyncio

        from actionopd_jax.envs.awm.fork import AwmForkPoint
        from actionopd_jax.envs.fork import FixedEffects, tool_effects_of
        from actionopd_jax.envs.mcp.env import _check_call

        self._forks = getattr(self, "_forks", 0) + 1
        before = await asyncio.to_thread(self.runtime.snapshot, self._server, self._dir / f"fork{self._forks}.db")
        return AwmForkPoint(self.runtime, self._scenario.name, before, list(self._tools), _check_call,
                            FixedEffects(tool_effects_of(self._task)))

    def score(self) -> dict[str, Any]:
        if self._task is None:
            raise EnvError("nothing to score: call reset(task) and run an episode first")
        if self._final is None and self._server is not None and not self._fault:
            self._snapshot()  # scored while running (the caller stopped early): grade what is there
        out = super().score()  # gives the lease back
        mode = self.runtime.verifier_mode(self._task.task_id, self._scenario, self._task.payload["task_idx"])
        if self._verdict is None:
            self._verdict = self._verify(mode)
        v = self._verdict
        out.update(reward=v.reward, success=v.success, verdict=v.verdict, verifier_mode=mode,
                   scenario=self._scenario.name)
        if "error" in v.details:
            out["verifier_error"] = str(v.details["error"])[:500]
        if "judge" in v.details:
            out["judge"] = v.details["judge"]
        self._cleanup()  # the verdict is kept; the database copies are not needed any more
        return out

    def close(self) -> None:
        """Give the lease back (if any) and remove the episode's files."""
        if self._server is not None:
            self._give_back(ok=not self._fault)
        self._cleanup()

    def __del__(self) -> None:
        super().__del__()
        self._cleanup()

    # --- internals ---------------------------------------------------------------------------

    def _finish(self, reason: str, *, fault: str = "") -> None:
        if not fault and self._server is not None and self._final is None:
            self._snapshot()  # before the lease goes back (the pool resets the database)
        super()._finish(reason, fault=fault)

    def _snapshot(self) -> None:
        try:
            self._final = self.runtime.snapshot(self._server, self._dir / "final.db")
        except Exception as err:  # noqa: BLE001 - the episode is then not gradable, with the reason
            self._fault = self._fault or f"final database unreadable: {type(err).__name__}: {err}"

    def _final_answer(self) -> str:
        last = self._messages[-1] if self._messages else {}
        return str(last.get("content") or "") if last.get("role") == "assistant" else ""

    def _verify(self, mode: str) -> Verdict:
        if self._fault or self._final is None:
            return Verdict("not_verified", mode, {"error": self._fault or "the episode has no final database"})
        sc, idx = self._scenario, self._task.payload["task_idx"]
        entry = sc.verifier(idx, mode)
        if entry is None:
            return Verdict("judge_error", mode, {"error": f"task {self._task.task_id} has no {mode} verifier"})
        initial = self.runtime.cache.initial(sc)
        if mode == "code":
            return verify_code(entry, initial, self._final, sandbox=self.runtime.sandbox,
                               final_answer=self._final_answer(), timeout_s=self.verifier_timeout_s)
        if self.runtime.judge is None:
            return Verdict("judge_error", "sql", {"error": "the SQL verifier needs the run's judge endpoint "
                                                           "(matcher.base_url / matcher.model); none is configured"})
        return verify_sql(entry, self._task.payload["task"], initial, self._final, sandbox=self.runtime.sandbox,
                          judge=self.runtime.judge, trajectory=self._messages, timeout_s=self.verifier_timeout_s)

    def _cleanup(self) -> None:
        d, self._dir = getattr(self, "_dir", None), None
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)
