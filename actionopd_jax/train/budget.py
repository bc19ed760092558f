"""`run.budget_*` in the training loop: the process's ledger of paid calls (paid_calls.py) built
from the config, the check before each step, and the totals every process has spent.

The cap is held by reservations (paid_calls.Ledger.reserve: each request batch holds its worst
case before it is sent). The check before a step asks the same question of the next batch:
the largest batch this run has reserved so far, or before any, the smallest batch the teacher
can make (its replies of max_tokens, a prompt of paid_calls.PROMPT_ALLOWANCE_TOKENS). So a run
whose cap cannot buy even that stops at step 0, before any request, and a step that starts
stops within itself at the first batch that would pass the cap (train/loop.py saves the state
before that step; the paid-for teacher samples are in the teacher cache).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from actionopd_jax.paid_calls import PROMPT_ALLOWANCE_TOKENS, ROLES, Ledger
from actionopd_jax.train import distributed


def caps_of(cfg: Any) -> dict[str, float]:
    r = cfg.run
    return {"usd": float(r.budget_usd or 0.0),
            **{f"{role}_tokens": float(getattr(r, f"budget_{role}_tokens") or 0) for role in ROLES}}


def ledger_from(cfg: Any) -> Ledger:
    """The run's ledger: caps (run.budget_*), prices and each role's max_tokens."""
    prices = {"teacher": cfg.teacher.price, "matcher": cfg.matcher.price, "user": cfg.env.user_price}
    max_tokens = {"teacher": cfg.teacher.max_tokens, "matcher": cfg.matcher.max_tokens,
                  "user": getattr(cfg.env, "user_max_tokens", None)}
    return Ledger(caps_of(cfg), prices, max_tokens)


def teacher_replies(cfg: Any) -> int:
    """Replies in one teacher batch: K for the collector (one state's samples), 1 for KD's and
    the evaluation agent's one reply per decision."""
    return int(cfg.collect.teacher_samples) if cfg.collect.kind == "actionopd" else 1


def global_totals(ledger: Ledger) -> tuple[float, dict[str, float]]:
    """(USD, {role: tokens}) every process has spent (resumes included)."""
    mine = [ledger.spend_usd] + [float(ledger.totals[r].tokens) for r in ROLES]
    summed = distributed.allgather(np.asarray(mine, np.float64)).sum(axis=0)
    return float(summed[0]), {r: float(summed[1 + i]) for i, r in enumerate(ROLES)}


def next_batch(cfg: Any, ledger: Ledger) -> tuple[str, float, int]:
    """(role, USD, tokens) the check before a step reserves: the largest batch reserved so far
    (module docstring), else the teacher's smallest batch."""
    if ledger.largest["role"]:
        return ledger.largest["role"], float(ledger.largest["usd"]), int(ledger.largest["tokens"])
    k = teacher_replies(cfg)
    usd, tokens = ledger.worst_case("teacher", PROMPT_ALLOWANCE_TOKENS, replies=k, requests=k)
    return "teacher", usd, tokens


def step_refusal(cfg: Any, ledger: Ledger, step: int, *, pays: bool) -> str | None:
    """Why step `step` must not start (None: it may); also sets the ledger's room for the
    step. `pays`: whether the run's source calls a paid model at all (KD from a recorded file
    and the synthetic source do not: nothing to forecast)."""
    spent, tokens = global_totals(ledger)
    ledger.begin_step(step, spent, tokens, _process_count())
    if not ledger.capped or not pays:
        return None
    role, usd, toks = next_batch(cfg, ledger)
    return ledger.refusal(role, usd, toks, spent_usd=spent, spent_tokens=tokens, before_step=step)


def _process_count() -> int:
    import jax

    return jax.process_count()


def calls_paid_models(cfg: Any) -> bool:
    """Whether the run's source asks a paid model (teacher endpoint, judge, user simulator)."""
    kind, teacher = cfg.collect.kind, cfg.teacher.kind
    if kind == "kd":
        return not cfg.kd.trajectories
    if kind == "opd":
        return teacher == "openai"
    return kind == "actionopd" and teacher != "self"


def spend_metrics(source: Any, ledger: Ledger) -> dict[str, float]:
    """The spend totals as metrics: the source's own meters where it has them (the collector's,
    with its cache hits), else the ledger's (KD, OPD: the ledger is their meter)."""
    meters = getattr(source, "meters", None)
    if meters is None or not hasattr(meters, "by_role"):
        return {f"collect/{k}": v for k, v in ledger.metrics().items()}
    out: dict[str, float] = {}
    for role, m in meters.by_role.items():
        out.update({f"collect/{role}/requests_total": float(m.requests),
                    f"collect/{role}/prompt_tokens_total": float(m.prompt_tokens),
                    f"collect/{role}/completion_tokens_total": float(m.completion_tokens),
                    f"collect/{role}/cached_prompt_tokens_total": float(m.cached_prompt_tokens),
                    f"collect/{role}/cache_hits_total": float(m.cache_hits)})
        if m.price:
            out[f"collect/{role}/spend_usd_total"] = m.spend_usd
    if any(m.price for m in meters.by_role.values()):
        out["collect/spend_usd_total"] = meters.spend_usd
    return out


def meter_partial_step(source: Any, ledger: Ledger) -> None:
    """A source's meters (restored to a given-up step's start) count what that step's requests
    cost: the ledger's totals beyond theirs, per role."""
    meters = getattr(source, "meters", None)
    if meters is None or not hasattr(meters, "add"):
        return
    from actionopd_jax.teacher.base import UsageReport

    usage = {}
    for role, m in meters.by_role.items():
        t = ledger.totals[role]
        usage[role] = UsageReport(http_calls=max(t.requests - m.requests, 0),
                                  prompt_tokens=max(t.prompt_tokens - m.prompt_tokens, 0),
                                  completion_tokens=max(t.completion_tokens - m.completion_tokens, 0),
                                  cached_prompt_tokens=max(t.cached_prompt_tokens - m.cached_prompt_tokens, 0))
    meters.add(usage)


__all__ = ["meter_partial_step", "spend_metrics", "calls_paid_models", "caps_of", "global_totals", "ledger_from", "next_batch", "step_refusal",
           "teacher_replies"]
