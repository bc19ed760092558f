"""Semantic matching of a student action against one teacher sample: programmatic rules
first (canonical.py, messages.py), an LLM judge for the remaining differences (judge.py),
orchestrated with verdict caching by matcher.py."""

from actionopd_jax.matching.canonical import canonical_json, compare_tool_calls, differing_paths, values_equal
from actionopd_jax.matching.judge import JUDGE_PROMPT_VERSION, JudgeConfig, JudgeOutcome, LLMJudge, parse_verdict
from actionopd_jax.matching.matcher import Matcher, MatcherStats
from actionopd_jax.matching.messages import messages_equal, normalize_message

__all__ = [
    "canonical_json", "compare_tool_calls", "differing_paths", "values_equal", "JUDGE_PROMPT_VERSION",
    "JudgeConfig", "JudgeOutcome", "LLMJudge", "parse_verdict", "Matcher", "MatcherStats", "messages_equal",
    "normalize_message",
]
