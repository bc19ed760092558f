"""The static feasibility screen's stage of a pool's admission manifest (paper B.1): screening
records in, the admitted list, drop reasons, funnel row and held-out split out.

A pool entry that was screened holds, beside what the audit wrote:
- "audited": the ids the deterministic audit and context selection admitted (the screen's input),
  and "audited_heldout", the held-out split drawn from them (a task the screen later passes
  again returns to it);
- "source_hashes": task id -> `envs.task_sources.TaskSource.source_hash`;
- "screening": {"judge": {...}, "records": {task id -> record}}, a record being
  {"verdict": "feasible" | "infeasible" | "error", "reason", "confidence", "model", "provider",
  "prompt_version", "source_hash", "time", "requests", "cut_sections"}.

Only "feasible" with the task's current source hash admits a task. "infeasible" drops it with
the judge's reason; "error" (no parseable verdict, or the endpoint failed) and a missing or stale
record (the source changed since) drop it too, as not screened: a task is never let through
without a verdict. Confidence is recorded for diagnosis and decides nothing (the paper's rule).
Applying is idempotent, so the audit re-applies the records it finds when it rewrites a pool.
"""

from __future__ import annotations

import collections
from typing import Any

SCREEN_STAGE = "static feasibility screen"
VERDICTS = ("feasible", "infeasible", "error")


def drop_reason(record: dict[str, Any] | None, source_hash: str | None) -> str:
    """Why a task does not pass the screen ("" when it does)."""
    if record is None:
        return "not screened (run `actionopd envs screen`)"
    if source_hash is None or record.get("source_hash") != source_hash:
        return "not screened since its source changed (run `actionopd envs screen`)"
    verdict = record.get("verdict")
    if verdict == "feasible":
        return ""
    if verdict == "infeasible":
        return f"infeasible: {record.get('reason', '')}"
    return f"screen error: {record.get('reason', '')}"


def _kind(reason: str) -> str:
    """The funnel's coarse reason (the manifest's "dropped" keeps the full one)."""
    if reason.startswith("infeasible"):
        return "judged infeasible"
    if reason.startswith("screen error"):
        return "no verdict (screen error)"
    return "not screened"


def apply_screening(entry: dict[str, Any]) -> dict[str, Any]:
    """`entry` (one pool of the manifest, holding "screening") with the screen applied, in place."""
    screening = entry.get("screening")
    if not isinstance(screening, dict):
        raise ValueError("the pool entry has no screening records")
    first = "audited" not in entry
    audited = list(entry["admitted"] if first else entry["audited"])
    held = list(entry.get("heldout") or []) if first else list(entry.get("audited_heldout") or [])
    hashes = entry.get("source_hashes") or {}
    records = screening.get("records") or {}
    dropped = {k: v for k, v in (entry.get("dropped") or {}).items() if k not in set(audited)}
    admitted, now = [], {}
    for tid in audited:
        why = drop_reason(records.get(tid), hashes.get(tid))
        if why:
            now[tid] = why
        else:
            admitted.append(tid)
    dropped.update(now)
    funnel = [row for row in entry.get("funnel") or [] if row.get("stage") != SCREEN_STAGE]
    funnel.append({"stage": SCREEN_STAGE, "kept": len(admitted),
                   "reasons": dict(collections.Counter(_kind(r) for r in now.values())),
                   "note": "confidence recorded, not a threshold"})
    kept = set(admitted)
    entry.update(audited=audited, audited_heldout=held, admitted=admitted, dropped=dropped, funnel=funnel,
                 heldout=[h for h in held if h in kept])
    screening["records"] = {tid: records[tid] for tid in audited if tid in records}
    return entry


def funnel_table(entry: dict[str, Any], title: str) -> str:
    """The manifest entry's funnel as the audit prints it."""
    from actionopd_jax.envs.admission import Funnel

    f = Funnel()
    for row in entry.get("funnel") or []:
        f.stage(row["stage"], int(row["kept"]), {}, row.get("note", ""))
        f.reasons[row["stage"]] = collections.Counter(row.get("reasons") or {})
    return f.table(title)


def unscreened(entry: dict[str, Any] | None, current_hashes: dict[str, str]) -> dict[str, str]:
    """Training task id -> why it lacks a current B.1 screening record in its pool's manifest
    entry (`current_hashes`: every task the run may draw -> its source hash now, from the pool
    directory as it is today); {} when every one was judged feasible on its present source."""
    screening = (entry or {}).get("screening")
    if not isinstance(screening, dict):
        return {tid: "not screened" for tid in current_hashes}
    records = screening.get("records") or {}
    out = {}
    for tid, now in current_hashes.items():
        why = drop_reason(records.get(tid), now)
        if why:
            out[tid] = why.split(" (run ")[0]
    return out


def pool_source_hashes(pool: str, directory: str, tasks: list, entry: dict[str, Any] | None) -> dict[str, str]:
    """Task id -> its source hash (envs/task_sources.py) read from the pool directory now: what
    the screen's record must carry for the task to count as screened."""
    from actionopd_jax.envs import task_sources

    if pool == "awm":
        from actionopd_jax.envs.awm.layout import load_awm

        modes = dict((entry or {}).get("verifier_modes") or {})
        sources = task_sources.awm_sources(load_awm(directory), tasks, modes)
    else:
        from actionopd_jax.envs.envscaler.layout import load_envscaler

        sources = task_sources.envscaler_sources(load_envscaler(directory), tasks)
    return {tid: s.source_hash for tid, s in sources.items()}


def screening_message(pool: str, gaps: dict[str, str], n_tasks: int, manifest: str) -> str:
    """What is missing, and the command that supplies it."""
    kinds = collections.Counter(gaps.values())
    what = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return (f"pool {pool!r}: {len(gaps)} of its {n_tasks} training tasks have no current B.1 feasibility-screen "
            f"record in env.manifest={manifest} ({what}; e.g. {sorted(gaps)[:3]}); run `actionopd envs screen "
            f"--env {pool} --manifest {manifest} --judge-url U --judge-model J`")
