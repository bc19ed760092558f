"""Teacher over any OpenAI-compatible chat-completions endpoint (vLLM, SGLang, DeepSeek,
DashScope, OpenRouter, OpenAI, our own `actionopd serve`), through the real `openai` client.

The request carries the state's public messages and the native tool schemas, exactly as the
student sees them (paper A.3). A reply cut at max_tokens is Invalid (an unfinished action is
no action) and is regenerated like any parser/schema failure.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from actionopd_jax.teacher.base import (
    MAX_REGENERATIONS,
    RegeneratingSampler,
    UsageReport,
    paid_replies,
)
from actionopd_jax.teacher.endpoint import PROVIDERS, ChatEndpoint, EndpointSettings
from actionopd_jax.types import Action, ChatMessage, Invalid, TeacherSample, ToolSchema


@dataclass(frozen=True)
class OpenAITeacherConfig(EndpointSettings):
    who: ClassVar[str] = "teacher"

    api_key_env: str | None = "OPENAI_API_KEY"
    temperature: float | None = 0.6
    top_p: float | None = 0.95
    max_tokens: int | None = 8192
    max_concurrency: int = 16
    prompt_version: str = "v1"             # bump when what the teacher is asked changes
    max_regenerations: int = MAX_REGENERATIONS
    use_n: bool | None = None              # None: from PROVIDERS


def reply_text(message: dict[str, Any]) -> str:
    """The reply as text: content followed by each tool call in the Qwen3 text format."""
    parts = [message.get("content") if isinstance(message.get("content"), str) else ""]
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        args = fn.get("arguments")
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        name = json.dumps(fn.get("name"), ensure_ascii=False)
        parts.append(f'<tool_call>\n{{"name": {name}, "arguments": {args_text}}}\n</tool_call>')
    return "\n".join(p for p in parts if p)


def _default_parser(message: dict[str, Any], tools: list[ToolSchema]) -> Action:
    from actionopd_jax.chat import action_from_openai_message  # lazy: keeps imports light

    return action_from_openai_message(message, tools, role="teacher")


class OpenAITeacher(RegeneratingSampler):
    """`Teacher` over an OpenAI-compatible endpoint. One instance per provider endpoint: its
    semaphore is the provider's concurrency limit."""

    def __init__(self, cfg: OpenAITeacherConfig, *, rng: random.Random | None = None,
                 parse_message: Callable[[dict[str, Any], list[ToolSchema]], Action] | None = None):
        self.cfg = cfg
        self._usage = UsageReport()
        self.endpoint = ChatEndpoint(cfg, who=f"teacher {cfg.provider}/{cfg.model}", rng=rng, usage=self._usage)
        self._parse = parse_message or _default_parser

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

    async def aclose(self) -> None:
        await self.endpoint.aclose()

    def request_kwargs(self, messages: list[ChatMessage], tools: list[ToolSchema], n: int) -> dict[str, Any]:
        return self.endpoint.request_kwargs(messages, tools, n)

    async def _request(self, messages: list[ChatMessage], tools: list[ToolSchema], n: int) -> list[TeacherSample]:
        """One logical request (with transport retries) for n replies, parsed."""
        choices = await self.endpoint.complete(messages, tools, n)
        prompt_tokens, completion_tokens = choices[0]["prompt_tokens"], choices[0]["completion_tokens_total"]
        share, extra = divmod(completion_tokens, len(choices))
        samples = []
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
        return await paid_replies(lambda n: self._request(messages, tools, n), m, batched=self.endpoint.supports_n,
                                  messages=messages, tools=tools, max_tokens=self.cfg.max_tokens)


__all__ = ["OpenAITeacher", "OpenAITeacherConfig", "PROVIDERS", "reply_text"]
