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

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from actionopd_jax.paid_calls import PROMPT_ALLOWANCE_TOKENS, ROLES, BudgetReached, Ledger, install
from actionopd_jax.train import distributed

log = logging.getLogger(__name__)
BUDGET_EXIT_CODE = 3     # run.budget_*: the next request batch would pass the cap; state saved


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
    if cfg.collect.kind == "opd":   # echo scoring: token ids in, no reply (baselines/opd.py)
        usd, tokens = ledger.worst_case("teacher", 1, replies=1, max_tokens=1)
        return "teacher", usd, tokens
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


PHASE_FILE = "paid_calls.json"   # a phase outside the trainer (the warm start): its ledger's totals


@contextlib.contextmanager
def phase_ledger(cfg: Any, run_dir: Path, what: str, ledger: Ledger | None = None) -> Iterator[Ledger]:
    """The ledger of paid calls made outside a trainer (the main job's warm start asks the
    teacher for its trajectories before any training): run.budget_* caps them as one step,
    checked before the first request; the totals are kept in `run_dir`/paid_calls.json (a rerun
    counts on; the job's ActionOPD trainer starts from them). A reservation past the cap ends
    the phase as StoppedEarly with exit code 3 (finished episodes stay in their file).
    `ledger`: one built by the caller instead of from `cfg` (`actionopd eval`'s --price and
    --budget-usd)."""
    from actionopd_jax.train.sources import StoppedEarly

    path = Path(run_dir) / PHASE_FILE
    ledger = ledger if ledger is not None else ledger_from(cfg)
    if path.is_file():
        ledger.load(json.loads(path.read_text()))
    ledger.begin_step(0, ledger.spend_usd, {r: float(ledger.totals[r].tokens) for r in ROLES}, 1)
    if ledger.capped:
        # the phase's batches are the endpoint agent's: one reply per request
        role, usd, tokens = (ledger.largest["role"], ledger.largest["usd"], ledger.largest["tokens"]) \
            if ledger.largest["role"] else ("teacher", *ledger.worst_case("teacher", PROMPT_ALLOWANCE_TOKENS, 1))
        why = ledger.refusal(role, usd, tokens, spent_usd=ledger.spend_usd,
                             spent_tokens={r: float(ledger.totals[r].tokens) for r in ROLES}, before_step=0)
        if why:
            raise StoppedEarly(f"{what}: {why}", BUDGET_EXIT_CODE)
    previous = install(ledger)
    try:
        yield ledger
    except BudgetReached as e:
        raise StoppedEarly(f"{what}: {e}", BUDGET_EXIT_CODE) from None
    finally:
        install(previous)
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(ledger.state()))
        if ledger.totals["teacher"].requests:
            log.info("%s: the paid models cost $%.4f so far (%s)", what, ledger.spend_usd, path)


def carry_phase_spend(ledger: Ledger, phase_dir: Path) -> None:
    """A fresh trainer's ledger starts from a phase's totals (the warm start's teacher episodes
    count against the same run.budget_*)."""
    path = Path(phase_dir) / PHASE_FILE
    if path.is_file() and not any(t.requests for t in ledger.totals.values()):
        ledger.load(json.loads(path.read_text()))


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


__all__ = ["BUDGET_EXIT_CODE", "PHASE_FILE", "carry_phase_spend", "phase_ledger", "meter_partial_step", "spend_metrics", "calls_paid_models", "caps_of", "global_totals", "ledger_from", "next_batch", "step_refusal",
           "teacher_replies"]
