"""One OpenAI-compatible chat endpoint: the provider table, the API key from the
environment, the real `openai.AsyncOpenAI` client, a concurrency limit, transport retries and
strict parsing of the completion body. Used by the teacher provider and the LLM judge.

Provider differences live in one small table (`actionopd_jax.providers.PROVIDERS`, shared
with the tau2 user simulator): how thinking is switched on or off, whether `n > 1` is honoured
in one request, whether a non-standard `top_k` is accepted. A setting the provider cannot send
is refused when the endpoint is built, never dropped.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from actionopd_jax import paid_calls
from actionopd_jax.providers import PROVIDERS, cached_prompt_tokens, check_sendable, sampling_body, token_count
from actionopd_jax.teacher.base import UsageReport
from actionopd_jax.teacher.transport import MalformedResponse, RetryPolicy, RetryStats, call_with_retries

if TYPE_CHECKING:
    import openai


@dataclass(frozen=True)
class EndpointSettings:
    """The settings of one OpenAI-compatible endpoint, as `ChatEndpoint` reads them. The
    teacher, the matcher's judge, the environment screen and the summary drafter subclass it,
    each changing the defaults its role needs and adding its own fields; all are checked against
    the provider table when built (a setting the provider cannot send is refused)."""

    who: ClassVar[str] = "endpoint"   # names the role in error messages

    model: str
    base_url: str
    provider: str = "openai"               # a key of providers.PROVIDERS
    api_key_env: str | None = None         # NAME of the env var holding the key; None: no key
    thinking: bool | None = None           # None: no switch sent (the endpoint's default)
    reasoning_effort: str | None = None
    temperature: float | None = 0.0
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    seed: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 300.0       # one HTTP attempt
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_concurrency: int = 8               # requests in flight to this endpoint

    def __post_init__(self) -> None:
        check_settings(self, who=self.who)


def check_settings(cfg: EndpointSettings, *, who: str) -> None:
    if cfg.provider not in PROVIDERS:
        raise ValueError(f"{who}: unknown provider {cfg.provider!r}; choose one of {sorted(PROVIDERS)}")
    check_sendable(cfg.provider, top_k=cfg.top_k, thinking=cfg.thinking, who=who)
    if not cfg.model or not cfg.base_url:
        raise ValueError(f"{who}: config needs both 'model' and 'base_url'")
    if cfg.max_concurrency < 1:
        raise ValueError(f"{who}: max_concurrency must be >= 1, got {cfg.max_concurrency}")


def read_api_key(api_key_env: str | None, *, who: str) -> str:
    """The key from the named environment variable (never from config files)."""
    if api_key_env is None:
        return "EMPTY"  # local servers without auth; the openai client needs some string
    key = os.environ.get(api_key_env)
    if not key:
        raise ValueError(f"{who}: environment variable {api_key_env!r} is not set; export the API key there "
                         f"(or set api_key_env to null for an endpoint without authentication)")
    return key


def parse_completion_body(body: bytes) -> tuple[list[dict[str, Any]], int, int, int]:
    """(choices [{message, finish_reason}], prompt_tokens, completion_tokens, cached prompt
    tokens); a body that is not a usable completion raises MalformedResponse (retried like a
    transport error)."""
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
    return (out, token_count(usage.get("prompt_tokens")), token_count(usage.get("completion_tokens")),
            cached_prompt_tokens(usage))


class ChatEndpoint:
    """Sends chat completions to one endpoint with retries; counts calls/tokens in `usage`.

    The HTTP pool and the semaphore belong to one event loop, so they are rebuilt when the
    endpoint is used from a new loop (e.g. successive `asyncio.run` calls).
    """

    def __init__(self, cfg: EndpointSettings, *, who: str, rng: random.Random | None = None,
                 usage: UsageReport | None = None, paid_role: str | None = None):
        check_settings(cfg, who=who)
        self.cfg = cfg
        self.who = who
        self._api_key = read_api_key(cfg.api_key_env, who=who)
        self._rng = rng if rng is not None else random.Random()  # backoff jitter only
        self.usage = usage if usage is not None else UsageReport()
        # the paid role whose budget its requests draw on (paid_calls.py); None: not a training role.
        # `paid_role` names it where `who` does not (eval's agent, the screen judge, the summaries drafter)
        self.role = paid_role or {"teacher": "teacher", "judge": "matcher"}.get(who.split(" ", 1)[0])
        self._loop_resources: tuple[Any, openai.AsyncOpenAI, asyncio.Semaphore] | None = None

    def __repr__(self) -> str:
        return f"ChatEndpoint({self.who!r}, base_url={self.cfg.base_url!r})"

    @property
    def supports_n(self) -> bool:
        use_n = getattr(self.cfg, "use_n", None)
        return use_n if use_n is not None else PROVIDERS[self.cfg.provider].supports_n

    def _resources(self) -> tuple[openai.AsyncOpenAI, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._loop_resources is None or self._loop_resources[0] is not loop:
            import openai  # here, not at import: the trainer alone runs where the client is not installed

            client = openai.AsyncOpenAI(base_url=self.cfg.base_url, api_key=self._api_key, max_retries=0,
                                        timeout=self.cfg.request_timeout_s)
            self._loop_resources = (loop, client, asyncio.Semaphore(self.cfg.max_concurrency))
        return self._loop_resources[1], self._loop_resources[2]

    async def aclose(self) -> None:
        """Close the HTTP pool of the current loop (call once at shutdown)."""
        if self._loop_resources is not None and self._loop_resources[0] is asyncio.get_running_loop():
            await self._loop_resources[1].close()
        self._loop_resources = None

    def request_kwargs(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, n: int,
                       seed: int | None = None) -> dict[str, Any]:
        """Keyword arguments of `chat.completions.create` (pure; tested offline). `seed`: this
        request's seed instead of the configured one (the eval agent seeds each trial)."""
        c = self.cfg
        kwargs: dict[str, Any] = {"model": c.model, "messages": messages}
        if tools:
            kwargs["tools"] = tools
        if n > 1:
            kwargs["n"] = n
        kwargs.update(sampling_body(c.provider, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                                    max_tokens=c.max_tokens, seed=c.seed if seed is None else seed, reasoning_effort=c.reasoning_effort,
                                    thinking=c.thinking, extra_body=c.extra_body, who=self.who))
        return kwargs

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, n: int = 1,
                       seed: int | None = None) -> list[dict[str, Any]]:
        """Choices ({message, finish_reason}) of one logical request, after transport retries.
        Raises TransportGaveUp or PermanentRequestError."""
        client, sem = self._resources()
        kwargs = self.request_kwargs(messages, tools, n, seed)

        async def attempt() -> tuple[list[dict[str, Any]], int, int, int]:
            async with sem:
                self.usage.http_calls += 1
                raw = await client.chat.completions.with_raw_response.create(**kwargs)
            try:
                return parse_completion_body(raw.content)
            except MalformedResponse:
                self.usage.malformed_replies += 1   # counted apart: a provider's bad bodies show in the metrics
                raise

        stats = RetryStats()
        # its worst case is reserved against run.budget_* before anything is sent (paid_calls.py)
        with paid_calls.paid_request(self.role, messages, tools, replies=n, max_tokens=self.cfg.max_tokens) as ledger:
            try:
                choices, prompt_tokens, completion_tokens, cached = await call_with_retries(
                    attempt, self.cfg.retry, rng=self._rng, stats=stats)
            finally:
                self.usage.transport_retries += stats.retries
                if ledger is not None:
                    ledger.record(self.role, requests=stats.attempts)
            if ledger is not None:
                ledger.record(self.role, prompt_tokens=prompt_tokens, cached_prompt_tokens=cached,
                              completion_tokens=completion_tokens)
        self.usage.prompt_tokens += prompt_tokens
        self.usage.completion_tokens += completion_tokens
        self.usage.cached_prompt_tokens += cached
        for ch in choices:
            ch["prompt_tokens"] = prompt_tokens
            ch["completion_tokens_total"] = completion_tokens
        return choices
