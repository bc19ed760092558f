"""An MCP tool server as an `Environment` (`env.name: mcp`).

An episode leases a server from the pool at reset (already reset by the pool), shows the
task's messages and the server's tools (minus a reset tool), executes each `ToolCall` through
tools/call, and ends at the first `Message` or `Invalid` reply (one user turn). The lease goes
back at the episode's end (done, `end`, or `score`, whichever comes first). A server fault
ends the episode: `step` raises `McpFault` (the collector records its `end_reason`), the
server is discarded, and `score()` names the reason; the other episodes are unaffected.

Task payload: "messages" (chat messages) or "prompt" (+ optional "system"); optional "tools"
(names to offer, default every listed tool). There is no task verifier here: reward is 0.0
(environment families with verifiers, AWM / EnvScaler, build on this class).
"""

from __future__ import annotations

import asyncio
from typing import Any

from actionopd_jax.envs.base import EnvError, assistant_message, check_step, tool_message
from actionopd_jax.envs.mcp.client import McpFault, McpServer
from actionopd_jax.envs.mcp.pool import McpPool
from actionopd_jax.envs.tool_args import check_tool_call, is_safe_identifier
from actionopd_jax.types import Action, Observation, Task, ToolCall


def task_messages(task: Task) -> list[dict]:
    payload = task.payload or {}
    if payload.get("messages"):
        return [dict(m) for m in payload["messages"]]
    if not payload.get("prompt"):
        raise ValueError(f"MCP task {task.task_id}: payload needs 'messages' or 'prompt'")
    system = [{"role": "system", "content": payload["system"]}] if payload.get("system") else []
    return system + [{"role": "user", "content": str(payload["prompt"])}]


def _check_call(call: ToolCall, tools: list) -> str | None:
    """The shared pre-execution checks (envs/tool_args.py) without its Python-identifier rule
    for the tool name: MCP names may hold '-' or '.', and the name only selects a listed tool
    (it never becomes a Python attribute)."""
    match = next((t for t in tools if t["function"]["name"] == call.name), None)
    if match is None or is_safe_identifier(call.name):
        return check_tool_call(call, tools, check_types=False)
    alias = {"type": "function", "function": {**match["function"], "name": "tool"}}
    problem = check_tool_call(ToolCall("tool", call.arguments), [alias], check_types=False)
    return problem.replace("'tool'", f"'{call.name}'") if problem else None


class McpEnv:
    name = "mcp"

    def __init__(self, pool: McpPool, *, max_tool_calls: int = 40):
        self.pool = pool
        self.max_tool_calls = max_tool_calls
        self._task: Task | None = None
        self._server: McpServer | None = None
        self._done = False

    async def reset(self, task: Task) -> Observation:
        if self._server is not None:
            self._give_back(ok=not self._fault)
        self._task, self._done, self._end_reason, self._fault = task, False, "", ""
        self._messages = task_messages(task)
        self._calls = 0
        self._errors = 0
        self._tools: list = []
        try:
            self._server = await self.pool.acquire()
        except McpFault as fault:
            self._finish(fault.end_reason, fault=fault.detail)
            raise
        hidden = {self.pool.reset_arg} if self.pool.reset_kind == "tool" else set()
        offered = (task.payload or {}).get("tools")
        self._tools = [t for t in self._server.tools if t["function"]["name"] not in hidden
                       and (offered is None or t["function"]["name"] in offered)]
        return self._observation()

    async def step(self, action: Action) -> tuple[Observation, bool]:
        check_step(action, started=self._task is not None, done=self._done)
        if not isinstance(action, ToolCall):
            self._messages.append(assistant_message(action, call_id=""))
            self._finish("completed")
            return self._observation(), True
        call_id = f"call_{self._calls}"
        self._calls += 1
        self._messages.append(assistant_message(action, call_id))
        problem = _check_call(action, self._tools)
        if problem is not None:
            text = f"Error: {problem}"
            self._errors += 1
        else:
            try:
                result = await self.pool.loop.run(self._server.call(action.name, action.arguments))
            except McpFault as fault:
                self._finish(fault.end_reason, fault=fault.detail)
                raise
            except asyncio.CancelledError:
                # the caller gave up mid-call (its own timeout): the server's state is unknown
                self._fault = "cancelled during a tool call"
                self._give_back(ok=False)
                raise
            text = result.text
            self._errors += result.is_error
        self._messages.append(tool_message(call_id, action.name, text))
        if self._calls >= self.max_tool_calls:
            self._finish("tool_call_limit")
        return self._observation(), self._done

    def end(self, reason: str) -> Observation:
        if self._task is None:
            raise EnvError("call reset(task) before end()")
        if not self._done:
            self._finish(reason)
        return self._observation()

    def score(self) -> dict[str, Any]:
        if self._task is None:
            raise EnvError("nothing to score: call reset(task) and run an episode first")
        out = {"reward": 0.0, "end_reason": self._end_reason or "running", "tool_calls": self._calls,
               "tool_errors": self._errors}
        if self._fault:
            out["fault"] = self._fault
        self._give_back(ok=not self._fault)  # scoring is the collector's last word on an episode
        return out

    def __del__(self) -> None:
        # an episode abandoned without score() (its caller failed) must not keep its lease
        try:
            self._give_back(ok=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # --- internals ---------------------------------------------------------------------------

    def _finish(self, reason: str, *, fault: str = "") -> None:
        self._done, self._end_reason = True, reason
        if fault:
            self._fault = fault
        self._give_back(ok=not fault)

    def _give_back(self, *, ok: bool) -> None:
        server, self._server = self._server, None
        if server is not None:
            self.pool.release_soon(server, ok=ok)

    def _observation(self) -> Observation:
        info: dict[str, Any] = {"tool_calls": self._calls}
        if self._done:
            info["end_reason"] = self._end_reason
        return Observation(messages=[dict(m) for m in self._messages], tools=list(self._tools),
                           done=self._done, info=info)
