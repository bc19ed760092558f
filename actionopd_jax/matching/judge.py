"""LLM judge for the differences the programmatic rules cannot settle (paper A.3).

The judge is a frozen model behind an OpenAI-compatible endpoint with our own prompt. It
sees, for two same-name tool calls: the tool schema, both argument objects, the JSON paths
where they differ, and the public conversation context; for two messages: both texts, the
public context and the available tools. It is asked about agreement of the immediate
operation or communicative act -- not correctness, not usefulness.

Verdict format (strict): the reply's last non-empty line must be exactly one of
``VERDICT: MATCH``, ``VERDICT: NO_MATCH``, ``VERDICT: AMBIGUOUS``, and no other line may
mention ``VERDICT``; earlier lines may hold a short justification; a leading closed
``<think>...</think>`` block is ignored. AMBIGUOUS -> "no_match" (paper: ambiguous judgements
are negative). A reply outside the format is asked again, at most `format_retries` times
(transport failures have their own retries in the endpoint). What still fails -- an API error,
a timeout, replies that never comply -- is "unavailable" (paper A.3: unavailable supervision,
not a negative match): the state group is then masked, never scored as a non-match.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from actionopd_jax.teacher.base import UsageReport
from actionopd_jax.teacher.endpoint import ChatEndpoint, EndpointSettings
from actionopd_jax.teacher.transport import PermanentRequestError, RetryPolicy, TransportGaveUp
from actionopd_jax.types import ChatMessage, Message, ToolCall, ToolSchema, Verdict

log = logging.getLogger(__name__)

JUDGE_PROMPT_VERSION = "judge-v1"
PROMPT_MARGIN_TOKENS = 256  # chat-template tokens and estimate slack around the judge's prompt

_SYSTEM = """You decide whether two actions proposed by an assistant at the same point of a \
conversation are the same action.

Compare only the immediate action: for tool calls, whether both calls would perform the same \
operation with the same effective arguments; for messages, whether both convey the same intent \
and the same factual content. Pay close attention to facts, identifiers, names, numbers, dates, \
units, negation, commitments and anything the user asked to be copied exactly. Formatting, \
wording, key order and harmless equivalent spellings do not matter. Do NOT judge which action is \
better, correct or useful: two actions that are both wrong in the same way are the same, and two \
actions are not the same merely because both would fail or change nothing.

Reply with at most two short sentences of justification, then a final line that is exactly one of:
VERDICT: MATCH
VERDICT: NO_MATCH
VERDICT: AMBIGUOUS
Use AMBIGUOUS only when the context does not allow a decision."""

_VERDICT_LINE = re.compile(r"^VERDICT: (MATCH|NO_MATCH|AMBIGUOUS)$")
_LEADING_THINK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)


def parse_verdict(reply: Any) -> Verdict | None:
    """The verdict of a judge reply under the strict format; None if it does not comply."""
    if not isinstance(reply, str):
        return None
    text = _LEADING_THINK.sub("", reply, count=1)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines or sum("VERDICT" in line.upper() for line in lines) != 1:
        return None
    m = _VERDICT_LINE.match(lines[-1])
    if m is None:
        return None
    return "match" if m.group(1) == "MATCH" else "no_match"  # AMBIGUOUS counts as no match


@dataclass(frozen=True)
class JudgeConfig(EndpointSettings):
    who: ClassVar[str] = "judge"

    api_key_env: str | None = "OPENAI_API_KEY"
    max_tokens: int | None = 128
    request_timeout_s: float = 60.0
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(max_attempts=4, max_total_s=180.0))
    max_concurrency: int = 16
    # the conversation shown to the judge: a fixed character budget, or (None) what is left of
    # the judge's window once its reply (max_tokens) and the rest of the prompt are counted
    context_chars: int | None = None
    context_window: int = 32768            # the judge model's window in tokens
    chars_per_token: float = 3.0           # conservative for JSON and code (English runs ~4)
    format_retries: int = 2                # extra requests after a reply outside the verdict format

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.format_retries < 0:
            raise ValueError(f"judge: format_retries must be >= 0, got {self.format_retries}")
        if self.context_chars is None and self.context_window <= (self.max_tokens or 0) + PROMPT_MARGIN_TOKENS:
            raise ValueError(f"judge: context_window={self.context_window} leaves no room for a prompt next to "
                             f"max_tokens={self.max_tokens}; give the judge model's real window")


@dataclass(frozen=True)
class JudgeOutcome:
    verdict: Verdict
    reason: str = ""     # why unavailable ("api: ..." / "format: ..."), for logs and the stats
    requests: int = 1    # judge requests made (format retries included)
    context_truncated: bool = False  # the conversation shown was cut to its budget


def render_context(messages: list[ChatMessage], budget: int) -> str:
    """Public context as text within `budget` characters (see `render_context_info`)."""
    return render_context_info(messages, budget)[0]


def render_context_info(messages: list[ChatMessage], budget: int) -> tuple[str, bool]:
    """(text, truncated): the system message (up to half the budget) and then the most recent
    messages that fit, oldest first; truncated says whether anything was cut or left out."""
    def one(m: ChatMessage) -> str:
        body = m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content"), ensure_ascii=False)
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            body += f"\n<call {fn.get('name')}({fn.get('arguments')})>"
        return f"[{m.get('role')}] {body}"

    budget = max(int(budget), 0)
    head: list[str] = []
    rest = list(messages)
    truncated = False
    if rest and rest[0].get("role") == "system":
        sys_text = one(rest.pop(0))
        truncated = len(sys_text) > budget // 2
        head.append(sys_text[: budget // 2] + " [...]" if truncated else sys_text)
    remaining = budget - sum(len(h) for h in head)
    tail: list[str] = []
    for m in reversed(rest):
        text = one(m)
        if len(text) > remaining:
            if not tail:  # always show the latest message, truncated from the front
                tail.append("[...] " + (text[len(text) - remaining:] if remaining > 0 else ""))
            truncated = True
            break
        tail.append(text)
        remaining -= len(text)
    omitted = len(rest) - len(tail)
    mid = [f"[... {omitted} earlier message(s) omitted]"] if omitted > 0 else []
    return "\n".join(head + mid + list(reversed(tail))), truncated or omitted > 0


def tool_call_prompt(a: ToolCall, b: ToolCall, paths: tuple[str, ...], schema: ToolSchema | None,
                     context: str, evidence: str | None = None) -> str:
    dump = lambda v: json.dumps(v, ensure_ascii=False, sort_keys=True, indent=1)  # noqa: E731
    extra = [f"## Tool implementation evidence (for interpreting arguments only)\n{evidence}"] if evidence else []
    return "\n\n".join([
        f"## Tool schema\n{dump(schema) if schema is not None else '(schema not available)'}",
        *extra,
        f"## Conversation so far (public context)\n{context}",
        f"## Call A: {a.name}\n{dump(a.arguments)}",
        f"## Call B: {b.name}\n{dump(b.arguments)}",
        "## Argument paths where A and B differ\n" + "\n".join(f"- {p}" for p in paths),
        "Do calls A and B perform the same action?",
    ])


def message_prompt(a: Message, b: Message, tools: list[ToolSchema], context: str) -> str:
    names = []
    for t in tools:
        fn = t.get("function", {}) if isinstance(t, dict) else {}
        names.append(f"- {fn.get('name')}: {str(fn.get('description') or '')[:200]}")
    return "\n\n".join([
        "## Available tools\n" + ("\n".join(names) or "(none)"),
        f"## Conversation so far (public context)\n{context}",
        f"## Message A\n{a.text}",
        f"## Message B\n{b.text}",
        "Do messages A and B express the same communicative act (same intent and facts)?",
    ])


class LLMJudge:
    def __init__(self, cfg: JudgeConfig, *, rng: random.Random | None = None):
        self.cfg = cfg
        self.usage = UsageReport()
        self.endpoint = ChatEndpoint(cfg, who=f"judge {cfg.provider}/{cfg.model}", rng=rng, usage=self.usage)

    def __repr__(self) -> str:
        return f"LLMJudge(provider={self.cfg.provider!r}, model={self.cfg.model!r})"

    @property
    def identity(self) -> dict[str, Any]:
        c = self.cfg
        return {"provider": c.provider, "model": c.model, "prompt_version": JUDGE_PROMPT_VERSION,
                "decoding": {"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k,
                             "max_tokens": c.max_tokens, "thinking": c.thinking, "seed": c.seed,
                             "context_chars": c.context_chars, "context_window": c.context_window}}

    async def aclose(self) -> None:
        await self.endpoint.aclose()

    async def judge_tool_calls(self, a: ToolCall, b: ToolCall, paths: tuple[str, ...], *,
                               messages: list[ChatMessage], tools: list[ToolSchema],
                               evidence: str | None = None) -> JudgeOutcome:
        schema = next((t for t in tools if isinstance(t, dict) and t.get("function", {}).get("name") == a.name), None)
        return await self._ask(lambda context: tool_call_prompt(a, b, paths, schema, context, evidence), messages)

    async def judge_messages(self, a: Message, b: Message, *, messages: list[ChatMessage],
                             tools: list[ToolSchema]) -> JudgeOutcome:
        return await self._ask(lambda context: message_prompt(a, b, tools, context), messages)

    def context_budget(self, fixed_chars: int) -> int:
        """Characters of conversation the judge is shown: matcher.context_chars, else what the
        window leaves after the reply, a margin, the system prompt and the prompt's other parts."""
        c = self.cfg
        if c.context_chars is not None:
            return c.context_chars
        window_chars = int((c.context_window - (c.max_tokens or 0) - PROMPT_MARGIN_TOKENS) * c.chars_per_token)
        return max(window_chars - len(_SYSTEM) - fixed_chars, 0)

    async def _ask(self, build: Callable[[str], str], messages: list[ChatMessage]) -> JudgeOutcome:
        context, truncated = render_context_info(messages, self.context_budget(len(build(""))))
        outcome = await self._verdict_of(build(context))
        return dataclasses.replace(outcome, context_truncated=truncated)

    async def _verdict_of(self, prompt: str) -> JudgeOutcome:
        chat = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": prompt}]
        head = ""
        for attempt in range(1, self.cfg.format_retries + 2):
            try:
                choices = await self.endpoint.complete(chat, None, 1)
            except (TransportGaveUp, PermanentRequestError) as err:
                log.warning("judge unavailable: %s", err)
                return JudgeOutcome("unavailable", f"api: {err}", requests=attempt)
            content = choices[0]["message"].get("content")
            verdict = parse_verdict(content)
            if verdict is not None:
                return JudgeOutcome(verdict, "", requests=attempt)
            head = content[:200] if isinstance(content, str) else repr(content)[:200]
            log.warning("judge reply not in the verdict format (request %d of %d): %r", attempt,
                        self.cfg.format_retries + 1, head)
        return JudgeOutcome("unavailable", f"format: {head}", requests=self.cfg.format_retries + 1)
