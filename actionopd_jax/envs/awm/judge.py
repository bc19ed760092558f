"""The SQL verifier's judge: the run's judge endpoint (the matcher's, `teacher.specs.judge_spec`)
as the callable `verify.verify_sql` takes (messages -> reply text), through the `openai` client.

It is synchronous: `Environment.score` is, and callers run it off their event loop (the
collector and `eval` do). The API key is read from the named environment variable when the
judge is built and is never logged or stored.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from actionopd_jax import paid_calls
from actionopd_jax.providers import cached_prompt_tokens, sampling_body

MIN_TOKENS = 512  # a classification with one or two sentences of reasoning (the matcher's own is 128)


def endpoint_judge(spec: Mapping[str, Any]):
    """`spec`: {"base_url", "model", "api_key_env", "provider", "temperature", "top_p", "top_k", "thinking",
    "max_tokens", "request_timeout_s"} (other keys of the judge spec are ignored)."""
    import openai

    if not spec.get("base_url") or not spec.get("model"):
        raise ValueError("the AWM SQL verifier's judge needs matcher.base_url and matcher.model")
    env = spec.get("api_key_env")
    key = os.environ.get(env, "") if env else "unused"
    if env and not key:
        raise ValueError(f"environment variable {env} (the judge endpoint's API key) is not set")
    client = openai.OpenAI(base_url=spec["base_url"], api_key=key, timeout=float(spec.get("request_timeout_s") or 120),
                           max_retries=3)
    model = spec["model"]
    # the matcher's sampling settings, spelled for its provider (actionopd_jax/providers.py)
    settings = sampling_body(spec.get("provider") or "openai", temperature=float(spec.get("temperature") or 0.0),
                             top_p=spec.get("top_p"), top_k=spec.get("top_k"), thinking=spec.get("thinking"),
                             max_tokens=max(int(spec.get("max_tokens") or 0), MIN_TOKENS), who="AWM SQL judge")
    max_tokens = max(int(spec.get("max_tokens") or 0), MIN_TOKENS)

    def judge(messages: list[dict[str, Any]]) -> str:
        # a paid call of the judge role: reserved against run.budget_* / eval --budget-usd first,
        # its reported usage recorded (paid_calls.py; nothing when no ledger is installed)
        with paid_calls.paid_request("matcher", messages, max_tokens=max_tokens) as ledger:
            try:
                reply = client.chat.completions.create(model=model, messages=messages, **settings)
            except Exception:
                if ledger is not None:
                    ledger.record("matcher", requests=1)
                raise
            if ledger is not None:
                usage = getattr(reply, "usage", None)
                ledger.record("matcher", requests=1,
                              prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0) if usage else 0,
                              completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0) if usage else 0,
                              cached_prompt_tokens=cached_prompt_tokens(usage) if usage else 0)
        return reply.choices[0].message.content or ""

    judge.model = model
    return judge
