"""Build the matcher (rules, plus an LLM judge when configured) from a judge spec
(`teacher.specs.judge_spec`, or a YAML recipe's `judge:` section), and the tool evidence the
judge reads from the environments."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from actionopd_jax.config import MatcherConfig
from actionopd_jax.matching.execution import ExecutionStage
from actionopd_jax.matching.judge import JudgeConfig, LLMJudge
from actionopd_jax.matching.matcher import Matcher
from actionopd_jax.teacher.cache import PersistentCache
from actionopd_jax.teacher.factory import make_from_spec


def build_matcher(judge_spec: Mapping[str, Any] | None, *, cache: PersistentCache | str | Path | None = None,
                  evidence: dict[str, str] | None = None,
                  evidence_by_env: Mapping[str, Mapping[str, str]] | None = None,
                  execution: str = "off") -> Matcher:
    """A Matcher with an LLM judge (or rules only when `judge_spec` is None). `evidence_by_env`:
    per environment, each tool's implementation evidence; the judge then needs it (a judged
    tool-call pair of such an environment without evidence for its tool is unavailable).
    `execution` (matcher.execution): "auto" adds the execution stage (matching/execution.py),
    which acts wherever the episode's environment offers forks of its state."""
    judge = LLMJudge(make_from_spec(JudgeConfig, judge_spec, section="judge")) if judge_spec is not None else None
    store = cache if (cache is None or isinstance(cache, PersistentCache)) else PersistentCache(cache)
    if execution not in ("auto", "off"):
        raise ValueError(f"matcher.execution must be 'auto' or 'off', got {execution!r}")
    stage = ExecutionStage() if execution == "auto" else None
    return Matcher(judge, cache=store, evidence=evidence, evidence_by_env=evidence_by_env, execution=stage)


def tool_evidence_from(m: MatcherConfig, tasks: list | None, env_factory: Any = None) -> dict[str, dict[str, str]] | None:
    """Per environment (or evidence scope, envs.evidence.evidence_scope), each tool's
    implementation evidence for the judge (matcher.tool_evidence). An environment factory that
    reads it from its live servers (AWM: `tool_evidence(tasks)`, which warms its pool) adds its own."""
    if not m.tool_evidence or m.kind == "rules" or not tasks:
        return None
    from actionopd_jax.envs.evidence import evidence_scope, task_tool_evidence, tool_evidence

    out = {}
    for env in sorted({t.env for t in tasks}):
        evidence = tool_evidence(env)
        if evidence is not None:
            out[env] = evidence
    for t in tasks:  # families whose environments bring their own tools (envs.evidence.evidence_scope)
        if evidence_scope(t) != t.env and evidence_scope(t) not in out:
            evidence = task_tool_evidence(t)
            if evidence is not None:
                out[evidence_scope(t)] = evidence
    from_servers = getattr(env_factory, "tool_evidence", None)
    if callable(from_servers):
        out.update(from_servers(tasks))
    return out
