"""A backend whose replies come from a Python function: reference teachers, scripted users,
judges with known verdicts. It is a real server answer over real HTTP, not a mocked client."""

from __future__ import annotations

import inspect
import json
import uuid
from typing import Any, Awaitable, Callable, Union

from actionopd_jax.serve.requests import ChatChoice, ChatRequest

Reply = Union[ChatChoice, list[ChatChoice]]
ReplyFn = Callable[[ChatRequest], Union[Reply, Awaitable[Reply]]]


def tool_call_choice(name: str, arguments: dict[str, Any], *, content: str | None = None) -> ChatChoice:
    call = {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}
    return ChatChoice(content=content, tool_calls=[call])


def message_choice(text: str, *, reasoning: str | None = None) -> ChatChoice:
    return ChatChoice(content=text, reasoning_content=reasoning)


class ScriptedBackend:
    """Answers each request with `reply(req)`; a single choice is repeated `n` times.

    `requests` keeps every request received, so tests can check what the client sent.
    """

    def __init__(self, model_name: str, reply: ReplyFn):
        self.model_name = model_name
        self._reply = reply
        self.requests: list[ChatRequest] = []

    async def complete(self, req: ChatRequest) -> tuple[list[ChatChoice], int]:
        self.requests.append(req)
        out = self._reply(req)
        if inspect.isawaitable(out):
            out = await out
        choices = list(out) if isinstance(out, list) else [out] * req.n
        prompt_chars = sum(len(str(m.get("content") or "")) for m in req.messages)
        return choices, max(1, prompt_chars // 4)  # rough token count; scripted replies have no tokenizer
