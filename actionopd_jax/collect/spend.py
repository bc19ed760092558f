"""The spend meters of the remote models a run pays for: the teacher, the matcher's LLM judge
and the user simulator. Each counts its role's requests, cache hits and tokens per step and for
the run, and money where the role has a price; the totals travel in the checkpoint (the group
source's state), so a resumed run counts on from where it stopped. run.budget_* is not read from
these: every request reserves its worst case on the paid-call ledger first (paid_calls.py).

Money needs a price (`teacher.price`, `matcher.price`, `env.user_price`: USD per million
[input, cached input, output] tokens); tokens are counted either way. Prompt tokens the vendor
says it read from its own prompt cache (`providers.cached_prompt_tokens`: an agent's growing
conversation is mostly a cached prefix) are priced at the cached rate, the rest at the input
rate; a vendor that does not say prices them all as input (the dearer reading). Cache hits of
our own caches cost nothing: they never reach the endpoint, so they add no tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from actionopd_jax.teacher.base import UsageReport
from actionopd_jax.train.spend_report import ROLES as REPORTED_ROLES

# metric prefixes: teacher/..., matcher/..., user/...; one order with the report's and the
# paid-call ledger's (paid_calls.ROLES)
ROLES = tuple(role for role, _ in REPORTED_ROLES)


@dataclasses.dataclass
class SpendMeter:
    price: tuple[float, ...] = ()
    role: str = "teacher"
    requests: int = 0
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0    # of prompt_tokens, read from the vendor's prompt cache
    spend_usd: float = 0.0
    last_step_usd: float = 0.0       # what the last step took (the cap itself is paid_calls.py's ledger)
    last_step_tokens: int = 0
    saved_calls: int = 0             # requests never sent: answered otherwise (the judge's: by execution, issue 45)

    def add(self, step: UsageReport, saved: int = 0) -> dict[str, float]:
        """Count one step's usage (`saved`: the step's requests answered without the endpoint);
        returns its figures and the totals, as metrics."""
        cached = min(step.cached_prompt_tokens, step.prompt_tokens)
        spend = (((step.prompt_tokens - cached) * float(self.price[0]) + cached * float(self.price[1])
                  + step.completion_tokens * float(self.price[2])) / 1e6 if self.price else 0.0)
        self.requests += step.http_calls
        self.cache_hits += step.cache_hits
        self.saved_calls += int(saved)
        self.prompt_tokens += step.prompt_tokens
        self.completion_tokens += step.completion_tokens
        self.cached_prompt_tokens += cached
        self.spend_usd += spend
        self.last_step_usd, self.last_step_tokens = spend, step.prompt_tokens + step.completion_tokens
        r = self.role
        out = {f"{r}/requests_total": float(self.requests), f"{r}/prompt_tokens_total": float(self.prompt_tokens),
               f"{r}/completion_tokens_total": float(self.completion_tokens),
               f"{r}/cached_prompt_tokens_total": float(self.cached_prompt_tokens),
               f"{r}/cache_hits_total": float(self.cache_hits), f"{r}/saved_calls_total": float(self.saved_calls)}
        if self.price:
            out.update({f"{r}/spend_usd": spend, f"{r}/spend_usd_total": self.spend_usd})
        return out

    def state(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("price", "role")}

    def load(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k in ("requests", "cache_hits", "prompt_tokens", "completion_tokens", "cached_prompt_tokens",
                     "last_step_tokens", "saved_calls"):
                setattr(self, k, int(v))
            elif k in ("spend_usd", "last_step_usd"):
                setattr(self, k, float(v))



class SpendMeters:
    """One SpendMeter per paid role, added up for the budget and the progress line."""

    def __init__(self, prices: dict[str, tuple[float, ...]]):
        self.by_role = {role: SpendMeter(price=tuple(prices.get(role, ())), role=role) for role in ROLES}

    @property
    def teacher(self) -> SpendMeter:
        return self.by_role["teacher"]

    def add(self, usage: dict[str, UsageReport], saved: dict[str, int] | None = None) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, meter in self.by_role.items():
            out.update(meter.add(usage.get(role, UsageReport()), (saved or {}).get(role, 0)))
        if any(m.price for m in self.by_role.values()):
            out["spend_usd_total"] = self.spend_usd
        return out

    @property
    def spend_usd(self) -> float:
        return sum(m.spend_usd for m in self.by_role.values())

    def state(self) -> dict[str, Any]:
        # the teacher's under "meter" as before (older checkpoints hold only that one)
        return {"meter": self.teacher.state(), "meters": {r: m.state() for r, m in self.by_role.items() if r != "teacher"}}

    def load(self, state: dict[str, Any]) -> None:
        self.teacher.load(state.get("meter", {}))
        for role, saved in (state.get("meters") or {}).items():
            if role in self.by_role:
                self.by_role[role].load(saved)

    def budget_figures(self) -> list[float]:
        """[spent USD (every priced role), the last step's USD, then for each of ROLES its
        tokens and its last step's tokens]. Figures only: run.budget_* is held by the paid-call
        ledger's reservations (paid_calls.py, train/budget.py), not forecast from these."""
        out = [self.spend_usd, sum(m.last_step_usd for m in self.by_role.values())]
        for role in ROLES:
            m = self.by_role[role]
            out += [float(m.prompt_tokens + m.completion_tokens), float(m.last_step_tokens)]
        return out


__all__ = ["ROLES", "SpendMeter", "SpendMeters"]
