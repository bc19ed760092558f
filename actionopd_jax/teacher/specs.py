"""The `teacher` and `matcher` config sections as plain specs: what `teacher.factory.build_teacher`
and `matching.build.build_matcher` take (the same dicts a YAML recipe's `teacher:` / `judge:`
sections give)."""

from __future__ import annotations

from typing import Any

from actionopd_jax.config import ConfigError, MatcherConfig, TeacherConfig


# teacher.kind: an OpenAI-compatible endpoint, Vertex AI, an in-process HF directory, the student
# itself (Self-ActionOPD), the embedded privileged reference teacher (tiny runs: it answers with
# the training tasks' solutions, baselines/wiring.py), or none; matcher.kind: rules then the LLM
# judge, or rules only
TEACHER_KINDS: tuple[str, ...] = ("openai", "vertex", "local", "self", "reference", "none")
MATCHER_KINDS: tuple[str, ...] = ("rules+llm", "rules")


def teacher_spec(t: TeacherConfig) -> dict[str, Any]:
    """teacher.* as a `teacher.factory.build_teacher` spec. kind=local is an HF directory sampled
    in-process: `teacher.hf_local.build_hf_local_teacher` builds it (it needs the run's mesh and
    tokenizer)."""
    if t.kind == "none":
        raise ConfigError("collect.kind=actionopd needs a teacher: set teacher.kind (openai | vertex | local) "
                          "with teacher.model (and teacher.base_url for openai)")
    if t.kind == "self":
        raise ConfigError("teacher.kind=self is Self-ActionOPD: its source is baselines.self_opd "
                          "(`actionopd train` picks it from the config); it has no endpoint spec")
    if t.kind == "reference":
        raise ConfigError("teacher.kind=reference is the embedded privileged reference teacher: the run starts it "
                          "(baselines/wiring.py); it has no endpoint spec")
    if t.kind == "local":
        return {"provider": "local", "model": t.model}
    if t.kind == "vertex":
        if t.provider not in ("", "vertex"):
            raise ConfigError(f"teacher.kind=vertex with teacher.provider={t.provider!r}: leave provider empty")
        # every sampling setting goes to generate_content; thinking: on = dynamic budget (-1)
        thinking_budget = None if t.enable_thinking is None else (-1 if t.enable_thinking else 0)
        return {"provider": "vertex", "model": t.model, "api_key_env": t.api_key_env or None,
                "temperature": t.temperature, "top_p": t.top_p,
                "top_k": t.top_k or None, "max_output_tokens": t.max_tokens, "thinking_budget": thinking_budget,
                "request_timeout_s": t.timeout_s, "max_concurrency": t.concurrency,
                "max_regenerations": t.retries}
    spec: dict[str, Any] = {"provider": t.provider or "openai", "model": t.model}
    spec.update(base_url=t.base_url, api_key_env=t.api_key_env or None, temperature=t.temperature,
                top_p=t.top_p, top_k=t.top_k or None, max_tokens=t.max_tokens, thinking=t.enable_thinking,
                reasoning_effort=t.reasoning_effort or None, max_regenerations=t.retries,
                request_timeout_s=t.timeout_s, max_concurrency=t.concurrency)
    return spec


def judge_spec(m: MatcherConfig) -> dict[str, Any] | None:
    """matcher.* as the judge's spec (an OpenAI-compatible endpoint); None for rules only."""
    if m.kind == "rules":
        return None
    return {"provider": m.provider or "openai", "model": m.model, "base_url": m.base_url,
            "api_key_env": m.api_key_env or None, "temperature": m.temperature, "top_p": m.top_p,
            "top_k": m.top_k or None, "max_tokens": m.max_tokens, "thinking": m.enable_thinking,
            "context_window": m.context_window, "context_chars": m.context_chars or None,
            "format_retries": m.format_retries,
            "request_timeout_s": m.timeout_s,
            "max_concurrency": m.concurrency}
