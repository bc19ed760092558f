"""`actionopd compare`'s outputs: compare.md (mean and spread over seeds per method), compare.png
(the held-out metrics per method, one dot per seed), compare.json, and the summary table
printed at the end. Columns: BFCL accuracy and agreement for each held-out evaluation
("whole" tasks, "first1" = their first user turn), same tool and validity for the first one.

Spread = the sample standard deviation over seeds (n-1); with 3 seeds it is a rough spread,
not a confidence interval.

Wall clock: "train s" is each run's training time (trainer setup and compiles, the steps to the
budget, the save and export; not the held-out evaluation), mean ± sd over seeds; "vs ActionOPD"
is a method's mean over ActionOPD's mean (0.5x: half the time), where both ran. On a shared
host it moves with the load; the runner interleaves methods seed by seed so both meet it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from actionopd_jax.experiment.report import _fmt, _plt

SHORT = {"bfcl_accuracy": "BFCL accuracy", "agreement_rate": "agrees with reference",
         "same_tool_rate": "same tool", "valid_rate": "valid action"}


def columns(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(evaluation name, metric key) of each metric column."""
    names = summary["info"]["evals"]
    out = [(n, k) for n in names for k in ("bfcl_accuracy", "agreement_rate")]
    return out + [(names[0], "same_tool_rate"), (names[0], "valid_rate")]


def label(col: tuple[str, str]) -> str:
    return f"{col[0]}: {SHORT[col[1]]}"


def _values(runs: list[dict[str, Any]], col: tuple[str, str]) -> list[float]:
    name, key = col
    return [float(r["eval"][name][key]) for r in runs
            if r.get("status") == "ok" and key in r.get("eval", {}).get(name, {})]


def mean_spread(values: list[float], pct: bool = True) -> str:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return "n/a"
    scale, unit = (100.0, "%") if pct else (1.0, "")
    m = scale * float(np.mean(vals))
    if len(vals) == 1:
        return f"{m:.1f}{unit} (1 seed)"
    sd = scale * float(np.std(vals, ddof=1))
    return f"{m:.1f} ± {sd:.1f}{unit}"


def by_method(summary: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in summary["results"]:
        out.setdefault(r["method"], []).append(r)
    return out


def train_seconds(runs: list[dict[str, Any]]) -> list[float]:
    return [float(r["train_s"]) for r in runs if r.get("status") == "ok" and "train_s" in r]


def wall_ratio(runs: list[dict[str, Any]], reference: list[dict[str, Any]] | None) -> str:
    """Mean train time over the reference method's mean ("-" when either has no run)."""
    mine, ref = train_seconds(runs), train_seconds(reference or [])
    if not mine or not ref or not np.mean(ref):
        return "-"
    return f"{np.mean(mine) / np.mean(ref):.2f}x"


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    """One row per method: status, budget, wall clock, held-out metrics (mean ± sd over seeds)."""
    cols = columns(summary)
    methods = by_method(summary)
    reference = methods.get("actionopd")
    rows = [["warm start only (every run's start)", "-", "0", "-", "-", "-",
             *(_fmt(summary["warm_start_eval"][n].get(k), pct=True) for n, k in cols)]]
    for name, runs in methods.items():
        first = runs[0]
        if first.get("status") == "not run":
            rows.append([first["label"], "not run", "-", "-", "-", "-", *["-"] * len(cols)])
            continue
        ok = [r for r in runs if r["status"] == "ok"]
        failed = len(runs) - len(ok)
        status = f"{len(ok)}/{len(runs)} seeds" + (f" ({failed} failed)" if failed else "")
        updates = sorted({r.get("updates") for r in runs if "updates" in r})
        samples = [r["teacher_samples"] for r in ok if "teacher_samples" in r]
        rows.append([first["label"], status, "/".join(str(u) for u in updates) or "-",
                     f"{np.mean(samples):.0f}" if samples else "-",
                     mean_spread(train_seconds(runs), pct=False), wall_ratio(runs, reference),
                     *(mean_spread(_values(runs, c)) for c in cols)])
    return rows


def header(summary: dict[str, Any]) -> list[str]:
    return ["method", "runs", "updates", "teacher samples", "train s", "train s vs ActionOPD",
            *(label(c) for c in columns(summary))]


def markdown_table(summary: dict[str, Any], rows: list[list[str]]) -> str:
    head = header(summary)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    plt = _plt()
    groups = [(name, runs) for name, runs in by_method(summary).items() if runs[0].get("status") != "not run"]
    cols = columns(summary)
    fig, axes = plt.subplots(1, len(cols), figsize=(2.9 * len(cols), 3.6), sharey=True)
    for ax, col in zip(axes, cols):
        for i, (name, runs) in enumerate(groups):
            vals = _values(runs, col)
            if vals:
                ax.bar(i, np.mean(vals), color="#4C72B0" if name == "actionopd" else "#8C8C8C", alpha=0.6)
                ax.scatter([i] * len(vals), vals, color="black", s=10, zorder=3)
        start = summary["warm_start_eval"][col[0]].get(col[1])
        if isinstance(start, (int, float)):
            ax.axhline(start, color="#DD8452", linestyle="--", linewidth=1, label="warm start only")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([n for n, _ in groups], rotation=40, ha="right", fontsize=8)
        ax.set_title(label(col), fontsize=9)
        ax.set_ylim(0, 1)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"held-out tasks, {summary['settings']['updates']} optimizer updates per run "
                 f"(bar: mean over seeds, dots: seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def steps_after_first(r: dict[str, Any]) -> str:
    """The trainer steps' wall clock after the first (which compiles): the steady state."""
    step_s = r.get("step_s") or []
    return f"{sum(step_s[1:]):.1f}" if len(step_s) > 1 else "-"


def staleness(r: dict[str, Any]) -> str:
    """An asynchronous run's groups trained at each age (0/1/...), those dropped as too old,
    and the seconds the update waited for data."""
    a = r.get("async")
    if not a:
        return "-"
    ages = sorted(int(k.split("_")[1]) for k in a if k.startswith("staleness_"))
    return (f"{'/'.join(str(int(a[f'staleness_{i}'])) for i in ages)}; dropped {int(a.get('stale_dropped', 0))}; "
            f"waited {a.get('wait_s', 0.0):.1f} s")


def per_run_table(summary: dict[str, Any]) -> str:
    cols = columns(summary)
    asynchronous = any(r.get("async") for r in summary["results"])
    head = ["method", "seed", "status", "updates", "steps", "teacher samples", "teacher requests",
            *(label(c) for c in cols), "train s", "steps 2+ s", "eval s",
            *(["groups trained at age 0/1/..; dropped; update waited"] if asynchronous else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["results"]:
        if r.get("status") == "not run":
            continue
        ev = r.get("eval", {})
        lines.append("| " + " | ".join(str(x) for x in (
            r["method"], r["seed"], r["status"] if r["status"] == "ok" else f"failed: {r.get('error', '')[:80]}",
            r.get("updates", "-"), r.get("steps", "-"), r.get("teacher_samples", "-"), r.get("teacher_requests", "-"),
            *(_fmt(ev.get(n, {}).get(k), True) for n, k in cols),
            r.get("train_s", "-"), steps_after_first(r), r.get("eval_s", "-"),
            *([staleness(r)] if asynchronous else []))) + " |")
    return "\n".join(lines)


def write(summary: dict[str, Any], run_dir: Path, *, command: str = "") -> Path:
    s = summary["settings"]
    info = summary["info"]
    (run_dir / "compare.json").write_text(json.dumps(summary, indent=1, default=str))
    png = run_dir / "compare.png"
    plot_error = ""
    try:
        plot(summary, png)
    except Exception as e:  # noqa: BLE001 - a plotting problem must not lose the table
        plot_error = f"(plot failed: {type(e).__name__}: {e})"
    not_run = [r for r in summary["results"] if r.get("status") == "not run"]
    md = [
        "# Equal-budget comparison",
        "",
        f"Command: `{command}`" if command else "",
        f"Wall time: {summary['wall_s'] / 60:.1f} min. Run directory: `{summary['run_dir']}`.",
        "",
        f"- Teacher: {info['teacher']}. Tasks: {len(info['train'])} training ("
        + (f"cut to their first {info['train_user_turns']} user turn(s)" if info["train_user_turns"] else "whole tasks")
        + f"), {len(info['heldout'])} held out, evaluated as {', '.join(info['evals'])} (whole: the whole "
        "multi-turn task; firstN: the task cut to its first N user turns, played and scored by the official "
        "checker on those turns only).",
        f"- One shared warm start{' (from the cache)' if info['warm_start_cached'] else ''}: {info['warm_start']}.",
        f"- Budget held equal: **{s['updates']} optimizer updates per run** (at most {summary['minibatch_rows']} "
        f"rows each; KD: {summary['minibatch_rows']} teacher turns each), lr {summary['lr']:g} for every method, "
        f"seeds {s['seeds']}. Teacher samples are not held equal; the table reports them (on-policy methods: "
        f"{summary['teacher_samples_per_state']} per visited state; KD: the teacher turns of its fresh episodes, "
        "successful or not, paper B.4's kd.trials per task start per step).",
        "- Metrics: held-out evaluation of every final policy, greedy (experiment/heldout.py): BFCL accuracy "
        "(official checker, whole episodes), and per decision at the reference policy's states: valid action, "
        "same tool, agreement with the reference action. Mean ± sample sd over seeds.",
        "",
        markdown_table(summary, table_rows(summary)),
        "",
        f"![held-out metrics](compare.png) {plot_error}",
        "",
    ]
    if not_run:
        md += ["Not run:", ""] + [f"- {r['label']}: {r['reason']}." for r in not_run] + [""]
    md += ["## Every run", "", per_run_table(summary), ""]
    path = run_dir / "compare.md"
    path.write_text("\n".join(line for line in md if line is not None))
    return path


def summary_text(summary: dict[str, Any]) -> str:
    rows = table_rows(summary)
    head = header(summary)
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join("{:<%d}" % w for w in widths)
    bar = "=" * (sum(widths) + 2 * (len(widths) - 1))
    out = [bar, f"compare summary: {summary['settings']['updates']} updates per run, seeds "
           f"{summary['settings']['seeds']}, {summary['wall_s'] / 60:.1f} min", bar, line.format(*head)]
    out += [line.format(*r) for r in rows]
    out.append(bar)
    return "\n".join(out)
