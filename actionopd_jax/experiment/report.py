"""The main job's report: report.md, PNG plots and the summary table printed at the end."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from actionopd_jax.matching.audit_report import AUDIT_MD, report_link_section
from actionopd_jax.train.spend_report import plot_spend, spend_history, spend_table
from actionopd_jax.train.async_report import async_history, async_table, plot_async

CURVES = (("reward_mean", "mean reward r_lambda"), ("match_rate", "match rate"), ("invalid_rate", "invalid rate"))
HELDOUT = (("bfcl_accuracy", "BFCL accuracy (official checker)"),
           ("episode_valid_rate", "valid actions in own episodes"),
           ("valid_rate", "valid at reference states"),
           ("same_tool_rate", "same tool as reference"),
           ("agreement_rate", "agrees with reference action"))


def _fmt(v: Any, pct: bool = False) -> str:
    if not isinstance(v, (int, float)) or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{100 * v:.1f}%" if pct else f"{v:.3f}"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(history: list[dict[str, float]], path: Path, *, final_is_probe: bool) -> None:
    plt = _plt()
    steps = [int(h["step"]) for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, (key, title) in zip(axes, CURVES):
        values = [h.get(key, float("nan")) for h in history]
        ax.plot(steps, values, marker="o", color="#4C72B0")
        if values:
            ax.axhline(values[0], color="#999999", linestyle="--", linewidth=1, label="warm start only (step 0)")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("policy after n ActionOPD updates")
        ax.set_xticks(steps)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    note = " (last point: final policy, measured without an update)" if final_is_probe else ""
    fig.suptitle(f"ActionOPD collection on the training tasks{note}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_warm_start(ws: dict[str, Any], path: Path) -> None:
    """Loss per update of the warm start's stages, one after the other."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    offset = 0
    for key, label, color in (("pretrain", "next-token pretraining (conversations)", "#55A868"),
                              ("kd", "KD (teacher turns)", "#DD8452")):
        losses = (ws.get(key) or {}).get("losses") or []
        if losses:
            ax.plot(range(offset + 1, offset + len(losses) + 1), losses, color=color, label=label)
            offset += len(losses)
    ax.set_xlabel("update")
    ax.set_ylabel("cross-entropy per target token")
    ax.set_title("warm start", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_heldout(before: dict[str, float], after: dict[str, float], path: Path) -> None:
    plt = _plt()
    import numpy as np

    labels = [title for _, title in HELDOUT]
    b = [100 * float(before.get(k, float("nan"))) for k, _ in HELDOUT]
    a = [100 * float(after.get(k, float("nan"))) for k, _ in HELDOUT]
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.bar(x - 0.2, b, 0.4, label="before ActionOPD (after KD)", color="#8C8C8C")
    ax.bar(x + 0.2, a, 0.4, label="after ActionOPD", color="#4C72B0")
    for i, (vb, va) in enumerate(zip(b, a)):
        ax.text(i - 0.2, (0 if math.isnan(vb) else vb) + 1, "n/a" if math.isnan(vb) else f"{vb:.1f}", ha="center", fontsize=7)
        ax.text(i + 0.2, (0 if math.isnan(va) else va) + 1, "n/a" if math.isnan(va) else f"{va:.1f}", ha="center", fontsize=7)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylim(0, 105)
    ax.set_ylabel("% (held-out tasks)")
    ax.legend(fontsize=7)
    ax.set_title("Held-out evaluation (greedy)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def curve_table(history: list[dict[str, float]]) -> str:
    lines = ["| step | policy | candidates | mean reward | match rate | invalid rate | committed reward | groups kept "
             "| unavailable groups | truncated |", "|---|---|---|---|---|---|---|---|---|---|"]
    last = len(history) - 1
    for i, h in enumerate(history):
        who = "warm start only" if i == 0 else ("final (no update)" if i == last else f"after {int(h['step'])} update step(s)")
        lines.append(f"| {int(h['step'])} | {who} | {int(h.get('candidates', 0))} | {_fmt(h.get('reward_mean'))} | "
                     f"{_fmt(h.get('match_rate'), True)} | {_fmt(h.get('invalid_rate'), True)} | "
                     f"{_fmt(h.get('committed_reward_mean'))} | {int(h.get('groups_retained', 0))}/{int(h.get('groups', 0))} | "
                     f"{_fmt(h.get('unavailable_rate'), True)} | {_fmt(h.get('truncated_rate'), True)} |")
    return "\n".join(lines)


def heldout_table(before: dict[str, float], after: dict[str, float]) -> str:
    lines = ["| held-out metric | before (after KD) | after ActionOPD |", "|---|---|---|"]
    for key, title in HELDOUT:
        lines.append(f"| {title} | {_fmt(before.get(key), True)} | {_fmt(after.get(key), True)} |")
    lines.append(f"| decisions at reference states | {int(before.get('decisions', 0))} | {int(after.get('decisions', 0))} |")
    lines.append(f"| episodes | {int(before.get('episodes', 0))} | {int(after.get('episodes', 0))} |")
    return "\n".join(lines)


def summary_text(s: dict[str, Any]) -> str:
    """The plain-text summary printed at the end of the job."""
    h = s["actionopd"]["history"]
    first, last = h[0], h[-1]
    rows = [("teacher", s["teacher"]["label"]),
            ("tasks (train / held-out)", f"{len(s['tasks']['train'])} / {len(s['tasks']['heldout'])} "
                                         f"BFCL {s['tasks']['category']} {'+'.join(s['tasks']['classes'])}"),
            ("student", s["student"]["description"]),
            ("warm start", s["warm_start"]["summary"] if s.get("warm_start") else "skipped"),
            ("ActionOPD mean reward", f"{_fmt(first['reward_mean'])} (warm start only) -> {_fmt(last['reward_mean'])} (final)"),
            ("ActionOPD match rate", f"{_fmt(first['match_rate'], True)} -> {_fmt(last['match_rate'], True)}"),
            ("ActionOPD invalid rate", f"{_fmt(first['invalid_rate'], True)} -> {_fmt(last['invalid_rate'], True)}"),
            ("ActionOPD unavailable groups", " / ".join(_fmt(x.get("unavailable_rate"), True) for x in h)
             + " per step (masked, never trained on)"),
            ("ActionOPD truncated replies", " / ".join(_fmt(x.get("truncated_rate"), True) for x in h)
             + " per step (Invalid, -1)")]
    b, a = s["eval"]["before"], s["eval"]["after"]
    for key, title in HELDOUT:
        rows.append((f"held-out {title}", f"{_fmt(b.get(key), True)} -> {_fmt(a.get(key), True)}"))
    overlapped = s.get("async")
    if overlapped:   # collect.max_staleness >= 1 (issue 44)
        by_age = overlapped["trained_by_staleness"]
        rows.append(("asynchronous collection", f"eta={overlapped['max_staleness']}: groups trained at staleness "
                     + " / ".join(f"{v:,.0f}" for v in by_age) + f" (0..{len(by_age) - 1}), "
                     f"{overlapped['dropped']:,.0f} dropped, update waited {overlapped['update_waited_s']:.1f}s"))
    spent = s.get("spend") or {}
    if spent:
        usd = sum(v for k, v in spent.items() if k.endswith("/spend_usd_total"))
        tokens = sum(v for k, v in spent.items() if k.endswith(("/prompt_tokens_total", "/completion_tokens_total")))
        rows.append(("remote models", f"{spent.get('teacher/requests_total', 0):,.0f} teacher requests, "
                                      f"{tokens:,.0f} tokens, ${usd:,.4f} (report.md: spend)"))
    rows.append(("run time", " + ".join(f"{k} {v:.0f}s" for k, v in s["timings"].items() if k != "total")
                 + f" = {s['timings']['total']:.0f}s"))
    rows.append(("run directory", s["run_dir"]))
    width = max(len(k) for k, _ in rows)
    bar = "=" * (width + 60)
    return "\n".join([bar, "main job summary", bar] + [f"{k:<{width}}  {v}" for k, v in rows] + [bar])


def write_report(run_dir: Path, s: dict[str, Any]) -> dict[str, Path]:
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": run_dir / "report.md", "json": out / "summary.json",
             "curves": out / "actionopd_curves.png", "heldout": out / "heldout_before_after.png"}
    history = s["actionopd"]["history"]
    plot_curves(history, paths["curves"], final_is_probe=True)
    plot_heldout(s["eval"]["before"], s["eval"]["after"], paths["heldout"])
    ws = s.get("warm_start")
    if ws and (ws.get("pretrain") or ws.get("kd")):
        paths["warm_start"] = out / "warm_start_loss.png"
        plot_warm_start(ws, paths["warm_start"])
    paths["json"].write_text(json.dumps(s, indent=2, default=str))
    privileged = s["teacher"]["privileged"]
    md = [f"# Main job report: {Path(s['run_dir']).name}", "",
          f"Teacher: **{s['teacher']['label']}**" + (
              " — it answers with the BFCL ground truth of the training tasks. It is a privileged stand-in that "
              "lets the whole pipeline run offline; its numbers are not those of any real teacher." if privileged else ""),
          f"Matching: {s['teacher']['matching']}", "",
          f"Student: {s['student']['description']}", "",
          f"Tasks: BFCL {s['tasks']['category']} tasks using only {', '.join(s['tasks']['classes'])}: "
          f"{len(s['tasks']['train'])} training, {len(s['tasks']['heldout'])} held out (split by sha256 of the task id).",
          f"- training: {', '.join(s['tasks']['train'])}", f"- held out: {', '.join(s['tasks']['heldout'])}", ""]
    if ws:
        md += ["## Warm start (training tasks)", "",
               "Teacher trajectories through the eval harness; the successful ones are kept. Next-token "
               "pretraining on each whole conversation (a random student's stand-in for pretraining: it learns to "
               "use its context), then KD on each teacher turn after its own prompt.", "", ws["summary"], "",
               "![warm start loss](report/warm_start_loss.png)" if "warm_start" in paths else "", ""]
    md += ["## ActionOPD steps (training tasks)", "",
           "Each row is one collection over every training task with the policy after that many update steps; "
           "step 0 is the starting point after the warm start (pretraining + KD) only and the last row is the final policy, measured without an update. "
           "Mean reward is over all candidates (invalid -1, valid non-matching 0, matching 1 + lambda (c-1)/(K-1)); "
           "match rate: candidates matching at least one teacher sample; invalid rate: candidates that are not one "
           "valid action.", "", curve_table(history), "", "![ActionOPD curves](report/actionopd_curves.png)", "",
           "## Held-out evaluation (greedy), before and after ActionOPD", "",
           "BFCL accuracy uses the official multi-turn checker on the student's own episodes. The finer metrics "
           "ask the student for its next action at every state of the reference path (same states for both "
           "students): *valid* = one valid action, *same tool* = same tool name (or both messages), *agrees* = "
           "matches the reference action under the matching rules.", "",
           heldout_table(s["eval"]["before"], s["eval"]["after"]), "",
           "![held-out](report/heldout_before_after.png)", ""]
    spend = spend_history(run_dir / "metrics.jsonl")
    if spend:   # what the ActionOPD phase's remote models cost (collect/spend.py's meters)
        paths["spend"] = out / "spend.png"
        plot_spend(spend, paths["spend"])
        md += ["## What the remote models cost (ActionOPD phase)", "",
               "Requests and tokens each role's endpoint reported, and money where the role has a price "
               "(`teacher.price`, `matcher.price`, `env.user_price`; the embedded teacher is priced at zero). Cache "
               "hits are our own caches: never paid.", "", spend_table(spend), "",
               "![spend](report/spend.png)", ""]
    history_async = async_history(run_dir / "metrics.jsonl")
    if history_async:   # collect.max_staleness >= 1 (issue 44)
        paths["async"] = out / "async.png"
        plot_async(history_async, paths["async"])
        md += ["## Asynchronous collection (ActionOPD phase)", "",
               "Episodes ran across updates; a group is trained on only while the policy that sampled it is at "
               "most collect.max_staleness updates old (older groups are dropped; their teacher samples stay in "
               "the cache), with the decoupled, truncated correction.", "", async_table(history_async), "",
               "![asynchronous collection](report/async.png)", ""]
    md += ["## Run", "", "| phase | seconds |", "|---|---|"]
    md += [f"| {k} | {v:.1f} |" for k, v in s["timings"].items()]
    md += ["", f"Checkpoint: `{s['actionopd']['checkpoint_dir']}` (step {s['actionopd']['checkpoint_step']}); "
               f"final student as an HF directory: `{s['actionopd']['final_student']}`.",
           "Logs: `train.log`; metrics: `metrics.jsonl` (ActionOPD), `warm_start/{pretrain,kd}/metrics.jsonl`; "
           "TensorBoard: `tb/`, `warm_start/*/tb/`; resolved config: `config.yaml` (what each phase ran with: "
           "`warm_start/*/config.yaml`, `actionopd_config.yaml`).", ""]
    if (run_dir / AUDIT_MD).exists():  # `actionopd audit-matcher` ran on this run before
        md += [report_link_section()]
    paths["markdown"].write_text("\n".join(md))
    return paths
