"""Score aggregation: BFCL accuracy per category, tau2 pass^k (paper appendix B.3)."""

from __future__ import annotations

from collections import defaultdict
from math import comb
from typing import Any, Iterable, Sequence


def pass_hat_k(successes: Sequence[int], trials: Sequence[int], k: int) -> float:
    """Mean over tasks of C(c, k) / C(n, k): the chance that k trials drawn without replacement
    from a task's n trials all succeed (pass^k, not best-of-k). Tasks with n < k are an error."""
    if k < 1:
        raise ValueError("k must be >= 1")
    if len(successes) != len(trials) or not trials:
        raise ValueError("need one (successes, trials) pair per task, and at least one task")
    total = 0.0
    for c, n in zip(successes, trials):
        if not 0 <= c <= n:
            raise ValueError(f"successes {c} not in [0, {n}]")
        if n < k:
            raise ValueError(f"pass^{k} needs at least {k} trials per task, a task has {n}")
        total += comb(c, k) / comb(n, k)
    return total / len(trials)


def group_by(records: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        out[tuple(r[k] for k in keys)].append(r)
    return dict(out)


def summarize(records: list[dict[str, Any]], *, ks: Sequence[int] = (1, 2, 3, 4)) -> list[dict[str, Any]]:
    """One row per (benchmark, category or split): episodes, mean reward and, where the
    benchmark defines them, BFCL official/strict accuracy or tau2 pass^1..pass^k."""
    rows = []
    for (env, group), recs in sorted(group_by(records, "env", "group").items()):
        row: dict[str, Any] = {"env": env, "group": group, "episodes": len(recs),
                               "reward": sum(r["score"]["reward"] for r in recs) / len(recs)}
        if all("tool_calls" in r for r in recs):  # episodes recorded before calls were counted lack it
            # replies (decisions) and tool calls apart: a reply with N parallel calls is 1 and N
            row.update(replies=sum(r["actions"] for r in recs), tool_calls=sum(r["tool_calls"] for r in recs),
                       parallel_replies=sum(r.get("parallel_replies", 0) for r in recs))
        if env == "bfcl":
            row["accuracy"] = sum(r["score"].get("official", r["score"]["reward"]) for r in recs) / len(recs)
            row["strict_accuracy"] = sum(r["score"].get("strict", 0.0) for r in recs) / len(recs)
            # bfcl_eval's executor also runs calls to tools offered only in a later turn (docs/decisions_collect.md)
            row["bfcl_eval_accuracy"] = sum(r["score"].get("bfcl_eval_official", r["score"].get("official", 0.0))
                                            for r in recs) / len(recs)
        else:
            if any("success" in r["score"] for r in recs):  # a verifier's / the checks' verdict (AWM, EnvScaler)
                row["success"] = sum(bool(r["score"].get("success")) for r in recs) / len(recs)
            per_task = group_by(recs, "task_id")
            succ = [sum(1 for r in rs if r["score"]["reward"] >= 1.0 - 1e-6) for rs in per_task.values()]
            n = [len(rs) for rs in per_task.values()]
            for k in ks:
                if all(t >= k for t in n):
                    row[f"pass^{k}"] = pass_hat_k(succ, n, k)
        rows.append(row)
    return rows
