"""The teacher's spend meter: each step's tokens and money, and the run's totals, which travel in
the checkpoint (the group source's state) so a resumed run counts on from where it stopped.

Money needs `teacher.price` (USD per million [input, cached input, output] tokens); tokens are
counted either way. The teacher client reports prompt tokens without splitting off cached ones,
so every prompt token is priced as uncached input (the dearest reading). Cache hits of our own
sample cache cost nothing: they never reach the endpoint, so they add no tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from actionopd_jax.teacher.base import UsageReport


@dataclasses.dataclass
class SpendMeter:
    price: tuple[float, ...] = ()
    requests: int = 0
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spend_usd: float = 0.0
    last_step_usd: float = 0.0       # what the last step took: the budget check's forecast
    last_step_tokens: int = 0

    def add(self, step: UsageReport) -> dict[str, float]:
        """Count one step's usage; returns its figures and the totals, as metrics."""
        spend = ((step.prompt_tokens * float(self.price[0]) + step.completion_tokens * float(self.price[2])) / 1e6
                 if self.price else 0.0)
        self.requests += step.http_calls
        self.cache_hits += step.cache_hits
        self.prompt_tokens += step.prompt_tokens
        self.completion_tokens += step.completion_tokens
        self.spend_usd += spend
        self.last_step_usd, self.last_step_tokens = spend, step.prompt_tokens + step.completion_tokens
        out = {"teacher/requests_total": float(self.requests), "teacher/prompt_tokens_total": float(self.prompt_tokens),
               "teacher/completion_tokens_total": float(self.completion_tokens),
               "teacher/cache_hits_total": float(self.cache_hits)}
        if self.price:
            out.update({"teacher/spend_usd": spend, "teacher/spend_usd_total": self.spend_usd})
        return out

    def state(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "price"}

    def load(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k in ("requests", "cache_hits", "prompt_tokens", "completion_tokens", "last_step_tokens"):
                setattr(self, k, int(v))
            elif k in ("spend_usd", "last_step_usd"):
                setattr(self, k, float(v))

    def budget_figures(self) -> list[float]:
        """[spent USD, the last step's USD, tokens, the last step's tokens] (train/loop.py's
        budget check sums them over processes)."""
        return [self.spend_usd, self.last_step_usd, float(self.prompt_tokens + self.completion_tokens),
                float(self.last_step_tokens)]


__all__ = ["SpendMeter"]
