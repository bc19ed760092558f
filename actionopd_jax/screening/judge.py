"""The feasibility judge: one OpenAI-compatible endpoint (teacher/endpoint.py: the provider table,
the key from a named environment variable, the real `openai` client, transport retries), asked
one task at a time with the screen's prompt.

A reply outside the format is answered with a note saying what is expected and asked again, at
most `format_retries` times; what still has no verdict -- replies that never comply, the
endpoint giving up or refusing the request -- is an "error" outcome, never "feasible".
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from actionopd_jax.screening.prompt import RETRY_NOTE, SYSTEM, PROMPT_VERSION, parse_reply
from actionopd_jax.teacher.base import UsageReport
from actionopd_jax.teacher.endpoint import ChatEndpoint, EndpointSettings
from actionopd_jax.teacher.transport import PermanentRequestError, RetryPolicy, TransportGaveUp

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScreenJudgeConfig(EndpointSettings):
    """The endpoint settings `ChatEndpoint` reads, plus the format retries. Defaults: T=0 and no
    thinking switch sent (the paper gives no settings for the screen; table 8's matcher, the
    same model, runs at T=0)."""

    who: ClassVar[str] = "screen judge"

    max_tokens: int | None = 1024
    request_timeout_s: float = 120.0
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(max_attempts=5, max_total_s=600.0))
    format_retries: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.format_retries < 0:
            raise ValueError(f"screen judge: format_retries must be >= 0, got {self.format_retries}")


@dataclass(frozen=True)
class ScreenOutcome:
    verdict: str                  # "feasible" | "infeasible" | "error"
    reason: str
    confidence: float | None = None
    requests: int = 0             # logical requests made for this task (format retries included)


class ScreenJudge:
    def __init__(self, cfg: ScreenJudgeConfig, *, rng: random.Random | None = None):
        self.cfg = cfg
        self.usage = UsageReport()
        self.endpoint = ChatEndpoint(cfg, who=f"screen judge {cfg.provider}/{cfg.model}", rng=rng, usage=self.usage,
                                     paid_role="matcher")   # the ledger's judge role (paid_calls.py)

    @property
    def identity(self) -> dict[str, Any]:
        """Who answers and how: part of every cache key, never a secret or a URL."""
        c = self.cfg
        return {"provider": c.provider, "model": c.model, "prompt_version": PROMPT_VERSION,
                "decoding": {"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k,
                             "max_tokens": c.max_tokens, "thinking": c.thinking,
                             "reasoning_effort": c.reasoning_effort, "seed": c.seed}}

    async def aclose(self) -> None:
        await self.endpoint.aclose()

    async def ask(self, prompt: str) -> ScreenOutcome:
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        head = ""
        tries = self.cfg.format_retries + 1
        for attempt in range(1, tries + 1):
            try:
                choices = await self.endpoint.complete(chat, None, 1)
            except (TransportGaveUp, PermanentRequestError) as err:
                log.warning("screen judge unavailable: %s", err)
                return ScreenOutcome("error", f"api: {err}", requests=attempt)
            content = choices[0]["message"].get("content")
            reply = parse_reply(content)
            if reply is not None:
                return ScreenOutcome(reply.verdict, reply.reason, reply.confidence, requests=attempt)
            head = content[:200] if isinstance(content, str) else repr(content)[:200]
            log.warning("screen judge reply not in the format (request %d of %d): %r", attempt, tries, head)
            chat = chat[:2] + [{"role": "assistant", "content": content if isinstance(content, str) else ""},
                               {"role": "user", "content": RETRY_NOTE}]
        return ScreenOutcome("error", f"format: no verdict in {tries} replies; last: {head!r}", requests=tries)
