"""What asynchronous collection did in a run (issue 44, collect.max_staleness >= 1), read back
from its metrics.jsonl (collect/async_source.py's `collect/async/*` metrics): how old the
trained groups were, how many were dropped, how long the update waited for data and the
rollout for weights, how busy the sampler was and how many teacher requests were in flight.

Written at the end of a training run that collected asynchronously (`async.md` + `async.png`
in the run directory, the table printed) and shown in the main job's report.md; a synchronous
run writes nothing.
"""

from __future__ import annotations

from pathlib import Path

from actionopd_jax.train.spend_report import rows_by_step

PREFIX = "collect/async/"


def async_history(metrics_jsonl: str | Path) -> list[dict[str, float]]:
    """One row per logged step with asynchronous metrics: {"step", "<name>"...} (names without
    the prefix; a step without the update's wait is not an asynchronous one)."""

    def row_of(rec: dict) -> dict[str, float]:
        row = {k[len(PREFIX):]: float(v) for k, v in rec.items()
               if k.startswith(PREFIX) and isinstance(v, (int, float))}
        return row if "wait_s" in row else {}

    return rows_by_step(metrics_jsonl, row_of)


def ages(history: list[dict[str, float]]) -> list[float]:
    """Retained groups trained at staleness 0, 1, ... over the run."""
    eta = max((int(h.get("max_staleness", 0)) for h in history), default=0)
    return [sum(h.get(f"staleness_{a}", 0.0) for h in history) for a in range(eta + 1)]


def async_table(history: list[dict[str, float]]) -> str:
    """The run's asynchronous collection as markdown ("" for a synchronous run)."""
    if not history:
        return ""
    n = len(history)
    eta = max(int(h.get("max_staleness", 0)) for h in history)
    by_age = ages(history)
    trained = sum(by_age) or 1.0

    def mean(key: str) -> float:
        return sum(h.get(key, 0.0) for h in history) / n

    def total(key: str) -> float:
        return sum(h.get(key, 0.0) for h in history)

    lines = ["| over the run's logged steps | value |", "|---|---|",
             f"| staleness bound (collect.max_staleness) | {eta} |",
             f"| steps | {n} |"]
    lines += [f"| groups trained at staleness {a} | {v:,.0f} ({v / trained:.0%}) |" for a, v in enumerate(by_age)]
    lines += [f"| groups dropped (older than {eta}) | {total('stale_dropped'):,.0f} |",
              f"| update waited for data | {total('wait_s'):,.1f} s ({mean('wait_s'):.2f} s a step) |",
              f"| rollout waited for weights | {total('swap_wait_s'):,.1f} s ({mean('swap_wait_s'):.2f} s a step) |",
              f"| sampler busy | {mean('sampler_busy_frac'):.0%} of the wall clock (mean of steps) |",
              f"| teacher requests in flight | {mean('teacher_in_flight'):.1f} (mean at a step's end) |",
              f"| trajectories in flight | {mean('trajectories_in_flight'):.1f} (mean at a step's end) |"]
    return "\n".join(lines)


def plot_async(history: list[dict[str, float]], path: Path) -> None:
    """Left: groups trained per step by staleness (stacked). Right: the update's wait for data
    and the rollout's wait for weights, per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(h["step"]) for h in history]
    eta = max(int(h.get("max_staleness", 0)) for h in history)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    bottom = [0.0] * len(history)
    for a in range(eta + 1):
        v = [h.get(f"staleness_{a}", 0.0) for h in history]
        left.bar(steps, v, bottom=bottom, label=f"staleness {a}")
        bottom = [b + x for b, x in zip(bottom, v)]
    dropped = [h.get("stale_dropped", 0.0) for h in history]
    if any(dropped):
        left.bar(steps, dropped, bottom=bottom, label="dropped", color="grey")
    left.set_xlabel("step")
    left.set_ylabel("groups")
    left.set_title("trained groups by staleness", fontsize=10)
    left.legend(fontsize=7)
    right.plot(steps, [h.get("wait_s", 0.0) for h in history], marker="o", label="update waited for data")
    right.plot(steps, [h.get("swap_wait_s", 0.0) for h in history], marker="o", label="rollout waited for weights")
    right.set_xlabel("step")
    right.set_ylabel("seconds")
    right.set_title("waits", fontsize=10)
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_async_report(run_dir: str | Path) -> dict:
    """async.md and async.png in `run_dir` from its metrics.jsonl; {"table": ""} for a
    synchronous run (nothing written)."""
    run = Path(run_dir)
    history = async_history(run / "metrics.jsonl")
    table = async_table(history)
    if not table:
        return {"table": ""}
    md, png = run / "async.md", run / "async.png"
    plot_async(history, png)
    md.write_text(f"# Asynchronous collection: {run.name}\n\nEpisodes ran across updates; a group is trained on "
                  f"only while the policy that sampled it is at most collect.max_staleness updates old (older "
                  f"groups are dropped; their teacher samples stay in the cache). Resumes included.\n\n{table}\n\n"
                  f"![asynchronous collection](async.png)\n")
    return {"table": table, "markdown": md, "png": png}


__all__ = ["async_history", "async_table", "plot_async", "write_async_report"]
