"""Fault injection for the OpenAI-compatible server: the failures a paid API really shows.

`FaultInjector` is an `OpenAIServer` middleware. For each chat request it either lets the
request through to the backend or answers with one fault:

- "rate_limit":   429 with a `Retry-After` header (seconds)
- "server_error": 500 with an OpenAI-style error body
- "hang":         waits `hang_s` before answering normally (the client should time out first)
- "malformed":    200 whose body is not JSON
- "invalid_tool_call": 200 with a well-formed completion whose tool call is unusable
                  (unparsable arguments or an unknown tool), i.e. a parser/schema failure
- "empty_choices": 200 with a well-formed completion body whose `choices` list is empty
                  (seen from real providers under load: not a usable reply, retried)
- "bad_args":     200 with a well-formed completion calling the request's first tool with
                  arguments that are not JSON (always this; "invalid_tool_call" draws between it
                  and an unknown tool)
- "reset_mid_body": 200 whose headers promise a whole completion, half of which is sent before
                  the connection drops (a proxy or load balancer resetting mid-reply)

Which fault comes next is drawn from a `random.Random(seed)` (the seed is required, so a
test is reproducible), or taken from an explicit `script` list first ("ok" = pass through).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from actionopd_jax.serve.openai_http import CutBody
from actionopd_jax.serve.requests import ChatChoice, ChatRequest, RequestError, completion_body

FAULT_KINDS = ("rate_limit", "server_error", "hang", "malformed", "invalid_tool_call", "empty_choices", "bad_args",
               "reset_mid_body")


@dataclass(frozen=True)
class FaultRates:
    rate_limit: float = 0.0
    server_error: float = 0.0
    hang: float = 0.0
    malformed: float = 0.0
    invalid_tool_call: float = 0.0
    empty_choices: float = 0.0
    bad_args: float = 0.0
    reset_mid_body: float = 0.0
    retry_after_s: float = 0.05    # value of the Retry-After header on 429
    hang_s: float = 2.0            # how long a "hang" stalls before answering

    def __post_init__(self) -> None:
        total = sum(getattr(self, k) for k in FAULT_KINDS)
        if any(getattr(self, k) < 0 for k in FAULT_KINDS) or total > 1.0 + 1e-9:
            raise ValueError(f"fault rates must be >= 0 and sum to <= 1, got total {total}")


class FaultInjector:
    def __init__(self, rates: FaultRates, *, seed: int, script: list[str] | None = None):
        for kind in script or []:
            if kind not in FAULT_KINDS and kind != "ok":
                raise ValueError(f"unknown fault {kind!r} in script; use one of {FAULT_KINDS + ('ok',)}")
        self.rates = rates
        self._rng = random.Random(seed)
        self._script = list(script or [])
        self.requests_seen = 0
        self.injected: Counter[str] = Counter()
        self._released = False

    def release_hangs(self) -> None:
        """End every current and future hang at once (call before stopping the server)."""
        self._released = True

    def _next_fault(self) -> str:
        if self._script:
            return self._script.pop(0)
        u = self._rng.random()
        acc = 0.0
        for kind in FAULT_KINDS:
            acc += getattr(self.rates, kind)
            if u < acc:
                return kind
        return "ok"

    async def __call__(self, body: Any) -> tuple[int, Any, dict[str, str]] | None:
        self.requests_seen += 1
        fault = self._next_fault()
        self.injected[fault] += 1
        if fault == "ok":
            return None
        if fault == "rate_limit":
            err = RequestError(429, "rate limit exceeded (injected)", "rate_limit_error", "rate_limit_exceeded")
            return 429, err.body(), {"Retry-After": f"{self.rates.retry_after_s:g}"}
        if fault == "server_error":
            return 500, RequestError(500, "internal error (injected)", "server_error").body(), {}
        if fault == "hang":
            # Poll instead of one long sleep so release_hangs() (another thread) can end it.
            deadline = time.monotonic() + self.rates.hang_s
            while time.monotonic() < deadline and not self._released:
                await asyncio.sleep(0.02)
            return None
        if fault == "malformed":
            return 200, b'{"id": "chatcmpl-broken", "choices": [{"index": 0, "message": ', {}
        if fault == "reset_mid_body":
            whole = json.dumps({"id": "chatcmpl-cut", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "x" * 512}, "finish_reason": "stop"}]}).encode()
            return 200, CutBody(whole[: len(whole) // 2], len(whole)), {}
        # the rest: a syntactically perfect completion carrying no usable action
        try:
            req = ChatRequest.from_json(body)
        except RequestError:
            return None  # let the server produce its own 400
        if fault == "empty_choices":
            return 200, completion_body(req, [], prompt_tokens=7), {}
        unparsable = {"name": _first_tool_name(req) or "lookup", "arguments": '{"unterminated": '}
        if fault == "bad_args":
            bad = unparsable
        else:
            bad = self._rng.choice([unparsable, {"name": "no_such_tool_injected", "arguments": "{}"}])
        call = {"id": "call_injected", "type": "function", "function": bad}
        choices = [ChatChoice(content=None, tool_calls=[call], completion_tokens=3) for _ in range(req.n)]
        return 200, completion_body(req, choices, prompt_tokens=7), {}


def _first_tool_name(req: ChatRequest) -> str | None:
    for tool in req.tools or []:
        return tool["function"]["name"]
    return None
