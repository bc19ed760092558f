"""Build teachers, the judge and the matcher from plain config dicts (the YAML recipe's
`teacher:` / `judge:` sections). Unknown keys are errors that list the accepted ones."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from actionopd_jax.teacher.base import Teacher
from actionopd_jax.teacher.cache import PersistentCache
from actionopd_jax.teacher.cached import CachedTeacher
from actionopd_jax.teacher.transport import RetryPolicy


def _make(cls: type, spec: Mapping[str, Any], *, section: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(spec) - names)
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {unknown}; accepted: {sorted(names)}")
    values = dict(spec)
    if isinstance(values.get("retry"), Mapping):
        values["retry"] = _make(RetryPolicy, values["retry"], section=f"{section}.retry")
    try:
        return cls(**values)
    except TypeError as e:  # a required key is missing
        raise ValueError(f"{section}: {e}") from None


def build_teacher(spec: Mapping[str, Any], *, cache: PersistentCache | str | Path | None = None,
                  local_generate: Any = None, local: Teacher | None = None) -> Teacher:
    """`spec["provider"]`: "vertex", "local" (needs `local_generate`, or `local`: a built
    in-process teacher such as teacher.hf_local's), or an OpenAI-compatible provider name (vllm,
    sglang, deepseek, dashscope, openrouter, openai, actionopd). With `cache` (a PersistentCache
    or a path) the teacher is wrapped in CachedTeacher."""
    spec = dict(spec)
    provider = spec.get("provider", "openai")
    if provider == "vertex":
        from actionopd_jax.teacher.vertex_provider import VertexTeacher, VertexTeacherConfig

        spec.pop("provider")
        teacher: Any = VertexTeacher(_make(VertexTeacherConfig, spec, section="teacher"))
    elif provider == "local" and local is not None:
        teacher = local
    elif provider == "local":
        from actionopd_jax.teacher.local_provider import LocalTeacher, LocalTeacherConfig

        if local_generate is None:
            raise ValueError("teacher.provider 'local' needs a generate function (the in-process sampler)")
        teacher = LocalTeacher(local_generate, _make(LocalTeacherConfig, spec, section="teacher"))
    else:
        from actionopd_jax.teacher.openai_provider import OpenAITeacher, OpenAITeacherConfig

        teacher = OpenAITeacher(_make(OpenAITeacherConfig, spec, section="teacher"))
    if cache is None:
        return teacher
    store = cache if isinstance(cache, PersistentCache) else PersistentCache(cache)
    return CachedTeacher(teacher, store)


def build_matcher(judge_spec: Mapping[str, Any] | None, *, cache: PersistentCache | str | Path | None = None,
                  evidence: dict[str, str] | None = None,
                  evidence_by_env: Mapping[str, Mapping[str, str]] | None = None) -> Any:
    """A Matcher with an LLM judge (or rules only when `judge_spec` is None). `evidence_by_env`:
    per environment, each tool's implementation evidence; the judge then needs it (a judged
    tool-call pair of such an environment without evidence for its tool is unavailable)."""
    from actionopd_jax.matching.judge import JudgeConfig, LLMJudge
    from actionopd_jax.matching.matcher import Matcher

    judge = LLMJudge(_make(JudgeConfig, judge_spec, section="judge")) if judge_spec is not None else None
    store = cache if (cache is None or isinstance(cache, PersistentCache)) else PersistentCache(cache)
    return Matcher(judge, cache=store, evidence=evidence, evidence_by_env=evidence_by_env)
