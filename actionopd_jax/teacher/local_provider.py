"""A teacher that runs in-process: any async `generate(messages, tools, n) -> list[str]`
(e.g. the Flax sampler with the current student weights, for Self-ActionOPD, paper 3.6/B.5).

The teacher may receive *privileged context* the student never sees (action guidance, private
user-goal summaries, reference actions): it is prepended to the teacher's copy of the system
message. Two sources, concatenated in this order: `LocalTeacherConfig.privileged_context`
(static, e.g. guidance) and `key_info["privileged_context"]` (per task). The caller's message
list is never modified. Because key_info is part of the cache key, per-task privileged text
keys the cache as well; put the weights version into `model` (e.g. "self@step-12") so cached
samples of one snapshot are never served for another (the paper clears the self-teacher cache
at each collection step).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from actionopd_jax.teacher.base import MAX_REGENERATIONS, TeacherBatch, UsageReport, sample_with_regeneration
from actionopd_jax.types import Action, ChatMessage, TeacherSample, ToolSchema

LocalGenerate = Callable[[list[ChatMessage], list[ToolSchema], int], Awaitable[list[str]]]


@dataclass(frozen=True)
class LocalTeacherConfig:
    model: str = "self"                      # include the weights version, see module docstring
    provider: str = "local"
    prompt_version: str = "v1"
    decoding: dict[str, Any] = field(default_factory=dict)  # recorded in the identity (cache key)
    privileged_context: str | None = None
    max_regenerations: int = MAX_REGENERATIONS


def with_privileged_context(messages: list[ChatMessage], privileged: str) -> list[ChatMessage]:
    """A copy of `messages` whose system message starts with `privileged` (a system message
    is inserted when there is none). The input list and its dicts are left untouched."""
    out = copy.deepcopy(messages)
    if not privileged:
        return out
    if out and out[0].get("role") == "system":
        original = out[0].get("content")
        original = original if isinstance(original, str) else ""
        out[0]["content"] = f"{privileged}\n\n{original}" if original else privileged
    else:
        out.insert(0, {"role": "system", "content": privileged})
    return out


def _default_text_parser(text: str, tools: list[ToolSchema]) -> Action:
    from actionopd_jax.chat import parse_teacher  # lazy: keeps this module importable alone

    return parse_teacher(text, tools)


def _reasoning_of(text: str) -> str:
    from actionopd_jax.chat.reply import split_reasoning

    reasoning, _visible, _error = split_reasoning(text)
    return reasoning


class LocalTeacher:
    def __init__(self, generate: LocalGenerate, cfg: LocalTeacherConfig | None = None, *,
                 parse_text: Callable[[str, list[ToolSchema]], Action] | None = None):
        self.generate = generate
        self.cfg = cfg or LocalTeacherConfig()
        self._parse = parse_text or _default_text_parser
        self._usage = UsageReport()

    def __repr__(self) -> str:
        return f"LocalTeacher(model={self.cfg.model!r})"

    @property
    def identity(self) -> dict[str, Any]:
        c = self.cfg
        return {"provider": c.provider, "model": c.model, "prompt_version": c.prompt_version,
                "decoding": c.decoding, "privileged_context": c.privileged_context}

    @property
    def usage(self) -> UsageReport:
        return self._usage

    def teacher_messages(self, messages: list[ChatMessage], key_info: dict[str, Any] | None) -> list[ChatMessage]:
        parts = [self.cfg.privileged_context, (key_info or {}).get("privileged_context")]
        privileged = "\n\n".join(p for p in parts if isinstance(p, str) and p)
        return with_privileged_context(messages, privileged)

    async def sample_detailed(self, messages: list[ChatMessage], tools: list[ToolSchema], k: int, *,
                              key_info: dict[str, Any] | None = None) -> TeacherBatch:
        prompt = self.teacher_messages(messages, key_info)

        async def gen(m: int) -> list[TeacherSample]:
            self._usage.http_calls += 1  # one generate call (no HTTP, same accounting)
            texts = list(await self.generate(prompt, tools, m))
            if len(texts) != m or not all(isinstance(t, str) for t in texts):
                raise RuntimeError(f"local generate returned {len(texts)} items for n={m}; expected {m} strings")
            return [TeacherSample(text=t, action=self._parse(t, tools), reasoning=_reasoning_of(t)) for t in texts]

        batch = await sample_with_regeneration(gen, k, max_regenerations=self.cfg.max_regenerations)
        self._usage.regenerations += batch.regenerations
        self._usage.invalid_replies += batch.invalid_replies
        return batch

    async def sample(self, messages: list[ChatMessage], tools: list[ToolSchema], k: int, *,
                     key_info: dict[str, Any] | None = None) -> list[TeacherSample]:
        return (await self.sample_detailed(messages, tools, k, key_info=key_info)).samples
