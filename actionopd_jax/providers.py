"""What each OpenAI-compatible vendor can be sent, and how it spells it: the one table the
teacher, the LLM judge and the tau2 user simulator build their request bodies from.

Standard chat-completions fields (temperature, top_p, max_tokens, seed, reasoning_effort) go
to every provider. Two settings are vendor extensions: `top_k` (an extra body field) and the
thinking switch (each vendor has its own). A provider that has no way to send a configured
extension refuses it (`UnsendableSetting`, naming the providers that can): a setting dropped
on the way would run the endpoint on its own defaults (paper table 8 would not hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ProviderTraits:
    supports_n: bool                                          # honours n > 1 in one request
    thinking_body: Callable[[bool], dict[str, Any]] | None    # extra_body fragment; None: no switch
    top_k_in_body: bool = True                                # accepts a non-standard top_k field


def _chat_template_switch(on: bool) -> dict[str, Any]:
    # Qwen3-style chat templates read enable_thinking from chat_template_kwargs.
    return {"chat_template_kwargs": {"enable_thinking": on}}


PROVIDERS: dict[str, ProviderTraits] = {
    "vllm": ProviderTraits(True, _chat_template_switch),
    "sglang": ProviderTraits(True, _chat_template_switch),
    "actionopd": ProviderTraits(True, _chat_template_switch),  # our own `actionopd serve`
    "deepseek": ProviderTraits(False, lambda on: {"thinking": {"type": "enabled" if on else "disabled"}}, False),
    "dashscope": ProviderTraits(False, lambda on: {"enable_thinking": on}),
    "openrouter": ProviderTraits(False, lambda on: {"reasoning": {"enabled": on}}),
    # OpenAI's own API: no top_k, no thinking switch (its reasoning models take reasoning_effort)
    "openai": ProviderTraits(True, None, False),
}


class UnsendableSetting(ValueError):
    """A configured setting the chosen provider has no field for."""


def senders(setting: str) -> list[str]:
    """The providers that can send `setting` ("top_k" or "thinking")."""
    if setting == "top_k":
        return sorted(p for p, t in PROVIDERS.items() if t.top_k_in_body)
    if setting == "thinking":
        return sorted(p for p, t in PROVIDERS.items() if t.thinking_body is not None)
    raise ValueError(f"unknown setting {setting!r}")


def unsendable(provider: str, *, top_k: int | None, thinking: bool | None) -> list[str]:
    """The configured extensions `provider` cannot send: "top_k" (when top_k is set, > 0) and
    "thinking" (when the switch is set, True or False)."""
    traits = provider_traits(provider)
    out = []
    if top_k and not traits.top_k_in_body:
        out.append("top_k")
    if thinking is not None and traits.thinking_body is None:
        out.append("thinking")
    return out


def provider_traits(provider: str) -> ProviderTraits:
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; choose one of {sorted(PROVIDERS)}")
    return PROVIDERS[provider]


def refusal(provider: str, setting: str, value: Any, *, key: str, off: str, provider_key: str = "provider") -> str:
    """One line: what cannot be sent, who can send it, how to switch it off instead."""
    return (f"{key}={value!r} cannot be sent to provider {provider!r} (it has no {setting} field); "
            f"providers that send it: {', '.join(senders(setting))}. Set {provider_key} to the server's "
            f"provider, or set {off}")


def check_sendable(provider: str, *, top_k: int | None, thinking: bool | None, who: str) -> None:
    """Raise UnsendableSetting for the first configured extension `provider` cannot send."""
    for setting in unsendable(provider, top_k=top_k, thinking=thinking):
        value, off = (top_k, "top_k to 0/None") if setting == "top_k" else (thinking, "thinking to None")
        raise UnsendableSetting(refusal(provider, setting, value, key=f"{who}.{setting}", off=off,
                                        provider_key=f"{who}.provider"))


def sampling_body(provider: str, *, temperature: float | None = None, top_p: float | None = None,
                  top_k: int | None = None, max_tokens: int | None = None, seed: int | None = None,
                  reasoning_effort: str | None = None, thinking: bool | None = None,
                  extra_body: dict[str, Any] | None = None, who: str = "endpoint") -> dict[str, Any]:
    """The sampling keyword arguments of `chat.completions.create` for `provider` (standard
    fields, plus `extra_body` with the vendor extensions); None values are not sent."""
    traits = provider_traits(provider)
    check_sendable(provider, top_k=top_k, thinking=thinking, who=who)
    kwargs: dict[str, Any] = {}
    for name, value in (("temperature", temperature), ("top_p", top_p), ("max_tokens", max_tokens),
                        ("seed", seed), ("reasoning_effort", reasoning_effort)):
        if value is not None:
            kwargs[name] = value
    extra: dict[str, Any] = {}
    if top_k:
        extra["top_k"] = top_k
    if thinking is not None and traits.thinking_body is not None:
        extra.update(traits.thinking_body(thinking))
    extra.update(extra_body or {})
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


def token_count(v: Any) -> int:
    """A token count from a reply's usage: a non-negative int, else 0 (absent, null, a string,
    a bool or a negative number from a sloppy server)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def cached_prompt_tokens(usage: Any) -> int:
    """Of a reply's prompt tokens, those the vendor served from its prompt cache (billed at the
    cached-input rate, often a tenth of the price). Vendors spell it differently: OpenAI,
    vLLM and OpenRouter `usage.prompt_tokens_details.cached_tokens`, DeepSeek
    `usage.prompt_cache_hit_tokens`. `usage` is the reply's usage as a dict or as the openai
    client's object; anything unreadable counts 0 (priced as uncached: the dearer reading), and
    the count never exceeds the prompt tokens."""
    if usage is None:
        return 0
    if not isinstance(usage, dict):
        dump = getattr(usage, "model_dump", None)
        usage = dump() if callable(dump) else {}
        if not isinstance(usage, dict):
            return 0
    details = usage.get("prompt_tokens_details")
    cached = token_count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    cached = cached or token_count(usage.get("prompt_cache_hit_tokens"))
    return min(cached, token_count(usage.get("prompt_tokens")))
