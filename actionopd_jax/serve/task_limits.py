"""Paper B.3's per-task limits, held by the server (issue 43 item 8): ToolSandbox's 30 messages
a conversation and AppWorld's 100,000 output tokens a task.

The benchmarks' own runners play the episodes against `actionopd serve`
(launch/benchmark_harness.py); a limit printed for the user to apply by hand was not applied.
The server cannot tell one task's requests from another's by itself, so each request names its
task in the OpenAI body's `user` field (a string the API already carries to the server and
that every client library can set: `user="toolsandbox/<scenario>/<trial>"`). Per task id:

- messages: a request whose task's conversation already holds `max_messages` messages (this
  request's, or the longest the task had with its reply) has no room for the reply (it would
  be message max_messages + 1): refused, 400 `task_message_limit`;
- output tokens: each reply's max_tokens is cut to what the task has left (replies in flight
  hold their whole allowance until they end), so the completion tokens a task was given never
  pass `max_output_tokens`; once nothing is left, 400 `task_token_budget_exhausted`.

A request without a task id is refused (400 `missing_task_id`): with no id the limits could
not hold. Refusals are 400s, not 429s, because clients retry a 429 and the limit stays.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from actionopd_jax.serve.requests import ChatChoice, ChatRequest, RequestError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TaskUse:
    requests: int = 0
    messages: int = 0        # the longest conversation seen, with its reply
    output_tokens: int = 0   # completion tokens of the task's finished replies
    reserved: int = 0        # allowances of its replies still being generated


class TaskLimitedBackend:
    """`backend` with per-task limits (None: that limit is off). `use` maps each task id to
    what it has used so far."""

    streams_live = False  # a reply's tokens are counted when it ends

    def __init__(self, backend: Any, *, max_messages: int | None = None, max_output_tokens: int | None = None):
        for name, value in (("max_messages", max_messages), ("max_output_tokens", max_output_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"task {name} must be >= 1, got {value}")
        self._backend = backend
        self.model_name = backend.model_name
        self.max_messages, self.max_output_tokens = max_messages, max_output_tokens
        self.use: dict[str, TaskUse] = {}

    @property
    def source(self):
        return getattr(self._backend, "source", None)

    def __getattr__(self, name: str):  # close(), warm_up(), max_context, ... of the wrapped backend
        return getattr(self._backend, name)

    def _task(self, req: ChatRequest) -> str:
        task = req.raw.get("user")
        if not isinstance(task, str) or not task.strip():
            raise RequestError(400, "this server holds paper B.3's per-task limits (actionopd serve --task-max-messages "
                                    "/ --task-max-output-tokens): name the request's task in the body's `user` "
                                    "field, e.g. user=\"appworld/<task id>\"", code="missing_task_id")
        return task

    async def complete(self, req: ChatRequest) -> tuple[list[ChatChoice], int]:
        task = self._task(req)
        use = self.use.setdefault(task, TaskUse())
        # the task's count, not only this request's: a client that resends a shortened history
        # does not get a task's conversation past the limit
        held = max(len(req.messages), use.messages)
        if self.max_messages is not None and held >= self.max_messages:
            log.info("task %s: refused at %d messages (limit %d)", task, held, self.max_messages)
            raise RequestError(400, f"task {task!r} reached its limit of {self.max_messages} messages (paper B.3): "
                                    f"its conversation holds {held}, a reply would pass it; end the episode",
                               code="task_message_limit")
        allowance = None
        if self.max_output_tokens is not None:
            left = self.max_output_tokens - use.output_tokens - use.reserved
            per_choice = left // max(1, req.n)
            if per_choice < 1:
                log.info("task %s: refused with %d of %d output tokens used", task, use.output_tokens,
                         self.max_output_tokens)
                raise RequestError(400, f"task {task!r} spent its budget of {self.max_output_tokens:,} output tokens "
                                        f"(paper B.3; {use.output_tokens:,} generated, {use.reserved:,} in replies "
                                        "still running): end the episode", code="task_token_budget_exhausted")
            cap = min(req.max_tokens or per_choice, per_choice)
            req = dataclasses.replace(req, max_tokens=cap)
            allowance = cap * max(1, req.n)
        use.requests += 1
        use.reserved += allowance or 0
        try:
            choices, prompt_tokens = await self._backend.complete(req)
        finally:
            use.reserved -= allowance or 0
        use.output_tokens += sum(c.completion_tokens for c in choices)
        use.messages = max(use.messages, len(req.messages) + 1)
        return choices, prompt_tokens


__all__ = ["TaskLimitedBackend", "TaskUse"]
