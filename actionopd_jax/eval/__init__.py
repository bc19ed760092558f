"""Evaluation: run an agent (checkpoint, HF directory, any OpenAI-compatible endpoint, or the
privileged reference policy) on BFCL multi-turn and tau2 with the benchmarks' own scoring."""
