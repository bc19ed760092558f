"""Semantic matching of a student action against one teacher sample: programmatic rules
first (canonical.py, messages.py), an LLM judge for the remaining differences (judge.py),
orchestrated with verdict caching by matcher.py."""
