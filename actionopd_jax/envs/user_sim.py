"""The tau2 user simulator: an LLM behind any OpenAI-compatible endpoint plays the customer.

The prompt is ours, built from the task's user scenario (persona, reason for calling, what
the user knows and does not know, extra instructions). The simulator sees the conversation
from its side: the agent's messages arrive as `user` turns, its own replies are `assistant`
turns, results of its own device tools (telecom) are `tool` turns. A reply containing one of
the signals `###STOP###`, `###TRANSFER###`, `###OUT-OF-SCOPE###` ends the episode.

Sampling settings reach the endpoint through the provider table (actionopd_jax/providers.py):
`top_k` and the thinking switch are spelled the way `provider` takes them, and a provider that
cannot take a configured one is refused when the simulator is built (paper table 8: the tau2
user runs with T=0.7, p=0.8, k=20 and thinking off).

Requests are retried as the teacher client retries them (teacher/transport.py: 429 / 5xx /
timeouts / connection errors, and a 200 body that is no usable reply), then the simulator is
UserSimUnavailable, naming its endpoint: the environment raises it, so the episode is neither a
score nor a finished episode (eval reruns it on resume), never a user_error scored 0.

The API key is read from the environment variable named in the config, at call time; it is
never stored in logs, caches or checkpoints.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import re
import threading
from typing import Any

from actionopd_jax import paid_calls
from actionopd_jax.providers import cached_prompt_tokens, check_sendable, provider_traits, sampling_body
from actionopd_jax.teacher.transport import (
    MalformedResponse,
    PermanentRequestError,
    RetryPolicy,
    TransportGaveUp,
    call_with_retries,
)

STOP = "###STOP###"
TRANSFER = "###TRANSFER###"
OUT_OF_SCOPE = "###OUT-OF-SCOPE###"
SIGNALS = (STOP, TRANSFER, OUT_OF_SCOPE)

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class UserSimConfig:
    base_url: str  # e.g. "http://127.0.0.1:8000/v1"
    model: str
    api_key_env: str | None = None  # name of the env var holding the key; None -> no key
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    thinking: bool | None = None  # None: no switch sent
    provider: str = "openai"  # a key of actionopd_jax.providers.PROVIDERS
    max_tokens: int | None = 1024
    timeout_s: float = 120.0
    max_retries: int = 5  # transport retries (the teacher's: 6 attempts in all), with the teacher's backoff
    retry_base_delay_s: float = 1.0  # the first backoff (then doubled, jittered: teacher/transport.py)
    extra_body: dict[str, Any] | None = None  # sent as is, after the provider's own fields


@dataclasses.dataclass
class UserSimUsage:
    """What the user simulators of this process have asked for: requests sent (failed ones
    too) and the tokens the endpoint reported. Named as the teacher's UsageReport fields, so
    the collector's spend meter reads both alike."""
    http_calls: int = 0
    cache_hits: int = 0  # never: a simulator turn is not cached (each depends on the episode)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    # Simulators run on several event loops at once (a pool's and an eval's threads): `+=` on a
    # shared int is a read-modify-write, so counts go through add() under a lock.
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, http_calls: int = 0, prompt_tokens: int = 0, completion_tokens: int = 0,
            cached_prompt_tokens: int = 0) -> None:
        with self._lock:
            self.http_calls += http_calls
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.cached_prompt_tokens += cached_prompt_tokens

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"http_calls": self.http_calls, "cache_hits": self.cache_hits,
                    "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                    "cached_prompt_tokens": self.cached_prompt_tokens}


# One counter for the process: the simulators are built inside the environment factories (one
# per pool, per eval, per KD agent), which the collector never sees; it reads the difference
# across a step (collect/collector.py), which is what this process's episodes asked for.
USAGE = UserSimUsage()


class UserSimUnavailable(RuntimeError):
    """The simulator could not produce a usable reply (API failure or empty answer after the
    retries, or its key unset). `where` names its endpoint (URL and model)."""

    def __init__(self, message: str, *, where: str = ""):
        super().__init__(message)
        self.where = where


@dataclasses.dataclass
class UserToolRequest:
    call_id: str
    name: str
    arguments: dict[str, Any] | None  # None: the arguments were not a JSON object
    raw_arguments: str


@dataclasses.dataclass
class UserReply:
    text: str | None
    tool_calls: list[UserToolRequest]


def has_signal(text: str) -> str | None:
    for signal in SIGNALS:
        if signal in text:
            return signal
    return None


_GUIDELINES = """You are playing a customer who has contacted a customer-service agent. Stay in character for the whole conversation and follow the scenario below.

How to behave:
- Write one message at a time, short and natural, the way this customer would write it.
- Use only information given in the scenario. If the agent asks for something the scenario does not give you, say that you do not know or do not have it. Never invent details.
- Give details when the agent asks for them; do not recite the whole scenario at once.
- Do not act as the agent and do not make decisions the scenario does not give you."""

_TOOL_GUIDELINES = """
- You have tools that act on your own phone or account. Use them only when the agent asks you to check or change something, one tool call at a time, and tell the agent what you saw. Never make up a tool result. A reply that contains a tool call is not shown to the agent, so send the agent a separate message afterwards.
- If the agent asks for several actions at once, do them one by one."""

_ENDING = f"""

Ending the conversation:
- When everything you wanted is done (or the agent has clearly settled it), reply with only {STOP}.
- If the agent transfers you to a human agent, reply with only {TRANSFER}.
- If the scenario gives you no way to continue, reply with only {OUT_OF_SCOPE}."""


def build_user_system_prompt(user_scenario: Any, *, with_tools: bool) -> str:
    """Our simulator prompt for a tau2 `UserScenario` (pydantic object or plain dict)."""
    scenario = user_scenario.model_dump() if hasattr(user_scenario, "model_dump") else dict(user_scenario or {})
    instructions = scenario.get("instructions")
    if isinstance(instructions, dict):
        fields = [
            ("Why you are contacting the agent", instructions.get("reason_for_call")),
            ("What you know", instructions.get("known_info")),
            ("What you do not know", instructions.get("unknown_info")),
            ("How to act", instructions.get("task_instructions")),
        ]
    else:
        fields = [("Instructions", instructions)]
    parts = []
    if scenario.get("persona"):
        parts.append(f"## Who you are\n{scenario['persona']}")
    for title, value in fields:
        if value:
            parts.append(f"## {title}\n{str(value).strip()}")
    guidelines = _GUIDELINES + (_TOOL_GUIDELINES if with_tools else "") + _ENDING
    return guidelines + "\n\n# Scenario\n" + "\n\n".join(parts)


class UserSimulator:
    """Stateless between calls: the environment passes the full conversation each time.
    One instance can serve many concurrent episodes."""

    def __init__(self, config: UserSimConfig):
        if not config.base_url or not config.model:
            raise ValueError("UserSimConfig needs base_url and model")
        if config.api_key_env is not None and not config.api_key_env.strip():
            raise ValueError("api_key_env must name an environment variable (or be None)")
        provider_traits(config.provider)  # unknown providers are refused here
        check_sendable(config.provider, top_k=config.top_k, thinking=config.thinking, who="user simulator")
        self.config = config
        self.where = f"user simulator endpoint {config.base_url} (model {config.model})"
        self._retry = RetryPolicy(max_attempts=max(0, int(config.max_retries)) + 1,
                                  base_delay_s=config.retry_base_delay_s)
        self._rng = random.Random()  # backoff jitter only
        # httpx connection pools belong to one event loop: keep one client, for the loop that
        # made it, and make a new one when called from another loop (compared by identity).
        self._client_loop: Any = None
        self._client_obj: Any = None

    def _client(self):
        from openai import AsyncOpenAI

        loop = asyncio.get_running_loop()
        if self._client_loop is not loop:
            key = "EMPTY"
            if self.config.api_key_env:
                key = os.environ.get(self.config.api_key_env, "")
                if not key:
                    raise UserSimUnavailable(
                        f"{self.where}: environment variable {self.config.api_key_env} (user simulator API key) is "
                        "not set", where=self.where)
            # retries are call_with_retries' (the teacher's rule), not the client's
            self._client_obj = AsyncOpenAI(base_url=self.config.base_url, api_key=key,
                                           timeout=self.config.timeout_s, max_retries=0)
            self._client_loop = loop
        return self._client_obj

    async def aclose(self) -> None:
        """Close the HTTP client (call from the loop that used it, e.g. at shutdown)."""
        if self._client_obj is not None and self._client_loop is asyncio.get_running_loop():
            await self._client_obj.close()
        self._client_obj = self._client_loop = None

    async def reply(
        self, system_prompt: str, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        *, seed: int | None = None,
    ) -> UserReply:
        """One simulator turn, retried as the teacher's requests are. Raises UserSimUnavailable
        (naming the endpoint) when the retries run out or the request is refused."""
        c = self.config
        request: dict[str, Any] = {
            "model": c.model,
            "messages": [{"role": "system", "content": system_prompt}, *conversation],
        }
        if tools:
            request["tools"] = tools
        request.update(sampling_body(c.provider, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                                     max_tokens=c.max_tokens, seed=seed, thinking=c.thinking,
                                     extra_body=c.extra_body, who="user simulator"))
        client = self._client()
        # its worst case is reserved against run.budget_* before it is sent (paid_calls.py)
        with paid_calls.paid_request("user", request["messages"], tools, max_tokens=c.max_tokens):
            try:
                return await call_with_retries(lambda: self._attempt(client, request), self._retry, rng=self._rng)
            except TransportGaveUp as exc:
                raise UserSimUnavailable(f"{self.where}: {exc}", where=self.where) from None
            except PermanentRequestError as exc:   # not retried (repeating a 4xx only costs)
                kind = type(exc.__context__).__name__ if exc.__context__ is not None else "refused"  # the SDK's class
                raise UserSimUnavailable(f"{self.where} refused the request ({kind}): {exc}", where=self.where) from None

    async def _attempt(self, client: Any, request: dict[str, Any]) -> UserReply:
        """One request; a reply with nothing usable is MalformedResponse (retried)."""
        USAGE.add(http_calls=1)
        response = await client.chat.completions.create(**request)
        usage = getattr(response, "usage", None)
        if usage is not None:
            USAGE.add(prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
                      completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
                      cached_prompt_tokens=cached_prompt_tokens(usage))
        ledger = paid_calls.current()
        if ledger is not None:
            ledger.record("user", requests=1, prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0) if usage else 0,
                          completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0) if usage else 0,
                          cached_prompt_tokens=cached_prompt_tokens(usage) if usage else 0)
        if not getattr(response, "choices", None) or response.choices[0].message is None:
            raise MalformedResponse("user simulator returned no choices")
        message = response.choices[0].message
        calls = []
        for i, call in enumerate(message.tool_calls or []):
            raw = call.function.arguments or "{}"
            try:
                args = json.loads(raw)
            except json.JSONDecodeError:
                args = None
            calls.append(UserToolRequest(call.id or f"user_call_{i}", call.function.name, args if isinstance(args, dict) else None, raw))
        text = _THINK.sub("", message.content or "").strip()
        if not calls and not text:
            raise MalformedResponse("user simulator returned an empty message")
        return UserReply(text=text or None, tool_calls=calls)
