"""The SQL verifier's judge: the run's judge endpoint (the matcher's, `teacher.specs.judge_spec`)
as the callable `verify.verify_sql` takes (messages -> reply text), through the `openai` client.

It is synchronous: `Environment.score` is, and callers run it off their event loop (the
collector and `eval` do). The API key is read from the named environment variable when the
judge is built and is never logged or stored.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

MIN_TOKENS = 512  # a classification with one or two sentences of reasoning (the matcher's own is 128)


def endpoint_judge(spec: Mapping[str, Any]):
    """`spec`: {"base_url", "model", "api_key_env", "temperature", "max_tokens", "request_timeout_s"}."""
    import openai

    if not spec.get("base_url") or not spec.get("model"):
        raise ValueError("the AWM SQL verifier's judge needs matcher.base_url and matcher.model")
    env = spec.get("api_key_env")
    key = os.environ.get(env, "") if env else "unused"
    if env and not key:
        raise ValueError(f"environment variable {env} (the judge endpoint's API key) is not set")
    client = openai.OpenAI(base_url=spec["base_url"], api_key=key, timeout=float(spec.get("request_timeout_s") or 120),
                           max_retries=3)
    model, temperature = spec["model"], float(spec.get("temperature") or 0.0)
    max_tokens = max(int(spec.get("max_tokens") or 0), MIN_TOKENS)

    def judge(messages: list[dict[str, Any]]) -> str:
        reply = client.chat.completions.create(model=model, messages=messages, temperature=temperature,
                                               max_tokens=max_tokens)
        return reply.choices[0].message.content or ""

    judge.model = model
    return judge
