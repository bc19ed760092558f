"""Teacher over any OpenAI-compatible chat-completions endpoint (vLLM, SGLang, DeepSeek,
DashScope, OpenRouter, OpenAI, our own `actionopd serve`), through the real `openai` client.

The request carries the state's public messages and the native tool schemas, exactly as the
student sees them (paper A.3). Provider differences live in one small table (`PROVIDERS`):
how thinking is switched on/off, whether `n > 1` is honoured, where `top_k` goes.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import openai

from actionopd_jax.teacher.base import (
    MAX_REGENERATIONS,
    TeacherBatch,
    UsageReport,
    gather_replies,
    sample_with_regeneration,
)
from actionopd_jax.teacher.transport import MalformedResponse, RetryPolicy, RetryStats, TransportGaveUp, call_with_retries
from actionopd_jax.types import Action, ChatMessage, Invalid, TeacherSample, ToolSchema


@dataclass(frozen=True)
class ProviderTraits:
    supports_n: bool                                  # honours n > 1 in one request
    thinking_body: Callable[[bool], dict[str, Any]]   # extra_body fragment switching thinking
    top_k_in_body: bool = True                        # accepts a non-standard top_k field


def _no_switch(_: bool) -> dict[str, Any]:
    return {}


PROVIDERS: dict[str, ProviderTraits] = {
    # Qwen3-style chat templates read enable_thinking from chat_template_kwargs.
    "vllm": ProviderTraits(True, lambda on: {"chat_template_kwargs": {"enable_thinking": on}}),
    "sglang": ProviderTraits(True, lambda on: {"chat_template_kwargs": {"enable_thinking": on}}),
    "actionopd": ProviderTraits(True, lambda on: {"chat_template_kwargs": {"enable_thinking": on}}),
    "deepseek": ProviderTraits(False, lambda on: {"thinking": {"type": "enabled" if on else "disabled"}}, False),
    "dashscope": ProviderTraits(False, lambda on: {"enable_thinking": on}),
    "openrouter": ProviderTraits(False, lambda on: {"reasoning": {"enabled": on}}),
    "openai": ProviderTraits(True, _no_switch, False),  # reasoning models: use reasoning_effort
}


@dataclass(frozen=True)
class OpenAITeacherConfig:
    model: str
    base_url: str
    provider: str = "openai"               # a key of PROVIDERS
    api_key_env: str | None = "OPENAI_API_KEY"  # NAME of the env var holding the key; None: no key
    thinking: bool | None = None           # None: provider default
    reasoning_effort: str | None = None
    temperature: float | None = 0.6
    top_p: float | None = 0.95
    top_k: int | None = None
    max_tokens: int | None = 8192
    seed: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    prompt_version: str = "v1"             # bump when what the teacher is asked changes
    request_timeout_s: float = 300.0       # one HTTP attempt
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_concurrency: int = 16              # requests in flight to this provider
    max_regenerations: int = MAX_REGENERATIONS
    use_n: bool | None = None              # None: from PROVIDERS

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise ValueError(f"unknown teacher provider {self.provider!r}; choose one of {sorted(PROVIDERS)}")
        if not self.model or not self.base_url:
            raise ValueError("teacher config needs both 'model' and 'base_url'")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


def read_api_key(api_key_env: str | None, *, who: str) -> str:
    """The key from the named environment variable (never from config files)."""
    if api_key_env is None:
        return "EMPTY"  # local servers without auth; the openai client needs some string
    key = os.environ.get(api_key_env)
    if not key:
        raise ValueError(f"{who}: environment variable {api_key_env!r} is not set; export the API key there "
                         f"(or set api_key_env to null for an endpoint without authentication)")
    return key


def reply_text(message: dict[str, Any]) -> str:
    """The reply as text: content followed by each tool call in the Qwen3 text format."""
    parts = [message.get("content") or ""]
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        parts.append(f'<tool_call>\n{{"name": {json.dumps(fn.get("name"), ensure_ascii=False)}, "arguments": {args_text}}}\n</tool_call>')
    return "\n".join(p for p in parts if p)


def parse_completion_body(body: bytes) -> tuple[list[dict[str, Any]], int, int]:
    """(choices [{message, finish_reason}], prompt_tokens, completion_tokens) or MalformedResponse."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedResponse(f"completion body is not JSON: {e}") from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices:
        raise MalformedResponse("completion body has no 'choices' list")
    out = []
    for ch in choices:
        msg = ch.get("message") if isinstance(ch, dict) else None
        if not isinstance(msg, dict):
            raise MalformedResponse("a choice has no 'message' object")
        out.append({"message": msg, "finish_reason": ch.get("finish_reason")})
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    def _int(v: Any) -> int:
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0
    return out, _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))


def _default_parser(message: dict[str, Any], tools: list[ToolSchema]) -> Action:
    from actionopd_jax.chat import action_from_openai_message  # lazy: chat pulls in tokenizers

    return action_from_openai_message(message, tools, role="teacher")


class OpenAITeacher:
    """`Teacher` over an OpenAI-compatible endpoint. One instance per provider endpoint: its
    semaphore is the provider's concurrency limit."""

    def __init__(self, cfg: OpenAITeacherConfig, *, rng: random.Random | None = None,
                 parse_message: Callable[[dict[str, Any], list[ToolSchema]], Action] | None = None):
        self.cfg = cfg
        self._api_key = read_api_key(cfg.api_key_env, who=f"teacher {cfg.provider}/{cfg.model}")
        self._rng = rng if rng is not None else random.Random()  # jitter only; results do not depend on it
        self._parse = parse_message or _default_parser
        self._usage = UsageReport()
        self._loop_resources: tuple[Any, openai.AsyncOpenAI, asyncio.Semaphore] | None = None

    def __repr__(self) -> str:
        return f"OpenAITeacher(provider={self.cfg.provider!r}, model={self.cfg.model!r}, base_url={self.cfg.base_url!r})"

    @property
    def identity(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "provider": c.provider, "model": c.model, "prompt_version": c.prompt_version,
            "decoding": {"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k, "max_tokens": c.max_tokens,
                         "seed": c.seed, "thinking": c.thinking, "reasoning_effort": c.reasoning_effort,
                         "extra_body": c.extra_body},
        }

    @property
    def usage(self) -> UsageReport:
        return self._usage

    def _resources(self) -> tuple[openai.AsyncOpenAI, asyncio.Semaphore]:
        # The HTTP pool and the semaphore belong to one event loop; rebuild them on a new loop.
        loop = asyncio.get_running_loop()
        if self._loop_resources is None or self._loop_resources[0] is not loop:
            client = openai.AsyncOpenAI(base_url=self.cfg.base_url, api_key=self._api_key, max_retries=0,
                                        timeout=self.cfg.request_timeout_s)
            self._loop_resources = (loop, client, asyncio.Semaphore(self.cfg.max_concurrency))
        return self._loop_resources[1], self._loop_resources[2]

    def request_kwargs(self, messages: list[ChatMessage], tools: list[ToolSchema], n: int) -> dict[str, Any]:
        """Keyword arguments of `chat.completions.create` (pure; tested offline)."""
        c = self.cfg
        traits = PROVIDERS[c.provider]
        kwargs: dict[str, Any] = {"model": c.model, "messages": messages}
        if tools:
            kwargs["tools"] = tools
        if n > 1:
            kwargs["n"] = n
        for name in ("temperature", "top_p", "max_tokens", "seed", "reasoning_effort"):
            value = getattr(c, name)
            if value is not None:
                kwargs[name] = value
        extra: dict[str, Any] = {}
        if c.top_k is not None and traits.top_k_in_body:
            extra["top_k"] = c.top_k
        if c.thinking is not None:
            extra.update(traits.thinking_body(c.thinking))
        extra.update(c.extra_body)
        if extra:
            kwargs["extra_body"] = extra
        return kwargs

    def _use_n(self) -> bool:
        return self.cfg.use_n if self.cfg.use_n is not None else PROVIDERS[self.cfg.provider].supports_n

    async def _request(self, messages: list[ChatMessage], tools: list[ToolSchema], n: int) -> list[TeacherSample]:
        """One logical request (with transport retries) for n replies, parsed."""
        client, sem = self._resources()
        kwargs = self.request_kwargs(messages, tools, n)

        async def attempt() -> tuple[list[dict[str, Any]], int, int]:
            async with sem:
                self._usage.http_calls += 1
                raw = await client.chat.completions.with_raw_response.create(**kwargs)
                return parse_completion_body(raw.content)

        stats = RetryStats()
        try:
            choices, prompt_tokens, completion_tokens = await call_with_retries(
                attempt, self.cfg.retry, rng=self._rng, stats=stats)
        finally:
            self._usage.transport_retries += stats.retries
        self._usage.prompt_tokens += prompt_tokens
        self._usage.completion_tokens += completion_tokens
        samples = []
        share, extra = divmod(completion_tokens, len(choices))
        for i, ch in enumerate(choices):
            msg = ch["message"]
            if ch["finish_reason"] == "length":
                action: Action = Invalid("reply truncated at max_tokens")
            else:
                action = self._parse(msg, tools)
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
            samples.append(TeacherSample(
                text=reply_text(msg), action=action, reasoning=reasoning if isinstance(reasoning, str) else "",
                prompt_tokens=prompt_tokens if i == 0 else 0,  # the prompt is paid once per request
                completion_tokens=share + (extra if i == 0 else 0)))
        return samples

    async def _generate(self, messages: list[ChatMessage], tools: list[ToolSchema], m: int
                        ) -> list[TeacherSample | BaseException]:
        if m > 1 and self._use_n():
            got: list[TeacherSample | BaseException] = list((await self._request(messages, tools, m))[:m])
            if len(got) < m:  # the server ignored n: top up with single requests
                got += await gather_replies(lambda: self._request(messages, tools, 1), m - len(got))
            return got
        return await gather_replies(lambda: self._request(messages, tools, 1), m)

    async def sample_detailed(self, messages: list[ChatMessage], tools: list[ToolSchema], k: int, *,
                              key_info: dict[str, Any] | None = None) -> TeacherBatch:
        batch = await sample_with_regeneration(lambda m: self._generate(messages, tools, m), k,
                                               max_regenerations=self.cfg.max_regenerations)
        self._usage.regenerations += batch.regenerations
        self._usage.invalid_replies += batch.invalid_replies
        self._usage.transport_failures += batch.transport_failures
        return batch

    async def sample(self, messages: list[ChatMessage], tools: list[ToolSchema], k: int, *,
                     key_info: dict[str, Any] | None = None) -> list[TeacherSample]:
        return (await self.sample_detailed(messages, tools, k, key_info=key_info)).samples


__all__ = ["OpenAITeacher", "OpenAITeacherConfig", "PROVIDERS", "ProviderTraits", "read_api_key",
           "reply_text", "parse_completion_body", "TransportGaveUp"]
