"""Build teachers from plain config dicts (the YAML recipe's `teacher:` section, or
`teacher.specs.teacher_spec`). Unknown keys are errors that list the accepted ones. The judge and
the matcher are built by matching/build.py (matching imports teacher, never the reverse)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from actionopd_jax.teacher.base import Teacher
from actionopd_jax.teacher.cache import PersistentCache
from actionopd_jax.teacher.cached import CachedTeacher
from actionopd_jax.teacher.transport import RetryPolicy


def make_from_spec(cls: type, spec: Mapping[str, Any], *, section: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(spec) - names)
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {unknown}; accepted: {sorted(names)}")
    values = dict(spec)
    if isinstance(values.get("retry"), Mapping):
        values["retry"] = make_from_spec(RetryPolicy, values["retry"], section=f"{section}.retry")
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
        teacher: Any = VertexTeacher(make_from_spec(VertexTeacherConfig, spec, section="teacher"))
    elif provider == "local" and local is not None:
        teacher = local
    elif provider == "local":
        from actionopd_jax.teacher.local_provider import LocalTeacher, LocalTeacherConfig

        if local_generate is None:
            raise ValueError("teacher.provider 'local' needs a generate function (the in-process sampler)")
        teacher = LocalTeacher(local_generate, make_from_spec(LocalTeacherConfig, spec, section="teacher"))
    else:
        from actionopd_jax.teacher.openai_provider import OpenAITeacher, OpenAITeacherConfig

        teacher = OpenAITeacher(make_from_spec(OpenAITeacherConfig, spec, section="teacher"))
    if cache is None:
        return teacher
    store = cache if isinstance(cache, PersistentCache) else PersistentCache(cache)
    return CachedTeacher(teacher, store)
