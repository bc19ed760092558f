"""Evaluation outputs: results.json, a markdown table, and a bar chart PNG."""

from __future__ import annotations

import json
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

NOTE = ("(percentages; BFCL accuracy is the official checker's verdict on the calls this harness executed, "
        "strict adds its irrelevance check; bfcl_eval_accuracy is the checker's verdict on the calls "
        "bfcl_eval's executor would have run, which also runs calls to tools offered only in a later turn; "
        "success is the environment's verifier verdict (AWM) or every check function passed (EnvScaler))")
# counts, not percentages: agent replies, the tool calls they made, replies with parallel calls
COUNT_ORDER = ("replies", "tool_calls", "parallel_replies")
METRIC_ORDER = ("accuracy", "strict_accuracy", "bfcl_eval_accuracy", "success", "pass^1", "pass^2", "pass^3", "pass^4", "reward")


def percent(fraction: float) -> str:
    """A score as the paper prints it (B.3): percent, one decimal, rounded half up. Python's
    own formatting rounds a binary float's exact value (6.25 -> "6.2"), so the value is first
    taken to 9 decimals (what a ratio of task counts can hold) and then rounded as a decimal."""
    return str(Decimal(repr(round(100 * fraction, 9))).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "No episode has finished yet.\n"
    metrics = [m for m in METRIC_ORDER if any(m in r for r in rows)]
    counts = [c for c in COUNT_ORDER if any(c in r for r in rows)]
    head = "| benchmark | group | episodes | " + " | ".join(metrics + [c.replace("_", " ") for c in counts]) + " |"
    sep = "|---|---|---|" + "---|" * (len(metrics) + len(counts))
    lines = [head, sep]
    for r in rows:
        cells = [percent(r[m]) if m in r else "" for m in metrics] + [str(r.get(c, "")) for c in counts]
        lines.append(f"| {r['env']} | {r['group']} | {r['episodes']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + NOTE + "\n"


def bar_chart(rows: list[dict[str, Any]], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for r in rows:
        metric = next(m for m in ("accuracy", "success", "pass^1", "reward") if m in r)
        labels.append(f"{r['env']}\n{r['group']}\n({metric})")
        values.append(100 * r[metric])
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(rows) + 1), 3.6))
    ax.bar(range(len(values)), values, color="#4C72B0")
    for i, v in enumerate(values):
        ax.text(i, v + 1, f"{v:.1f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylim(0, 105)
    ax.set_ylabel("%")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def evaluated_line(evaluated: dict[str, Any]) -> str:
    """What was scored, in words: the checkpoint step and folder, and a fallback if any."""
    if "step" not in evaluated:
        return f"Weights: {evaluated.get('hf', '?')}"
    line = f"Checkpoint: step {evaluated['step']} ({evaluated['step_dir']})"
    if evaluated.get("fallback_from") is not None:
        line += f", a fallback: step {evaluated['fallback_from']} was unreadable"
    if not evaluated.get("verified"):
        line += "; no checksum manifest, loaded unverified"
    return line


def write_report(out_dir: str | Path, rows: list[dict[str, Any]], *, agent: str, errors: list[str],
                 evaluated: dict[str, Any] | None = None, settings: dict[str, Any] | None = None,
                 settings_lines: list[str] | None = None, spend: dict[str, Any] | None = None,
                 spend_table: str = "") -> dict[str, Path]:
    """`settings`: what the episodes were played under (eval/settings.py), recorded with the
    scores; `settings_lines`: the same in words, for report.md. `spend`: what the paid models
    cost (eval/spend.py), with `spend_table` its markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "report.md", "png": out / "scores.png"}
    body = {"agent": agent, **({"evaluated": evaluated} if evaluated else {}),
            **({"settings": settings} if settings else {}), "summary": rows, "errors": errors,
            **({"spend": spend} if spend else {})}
    paths["json"].write_text(json.dumps(body, indent=2))
    md = f"# Evaluation of {agent}\n\n" + (f"{evaluated_line(evaluated)}\n\n" if evaluated else "")
    if settings_lines:
        md += "```\n" + "\n".join(settings_lines) + "\n```\n\n"
    md += markdown_table(rows)
    if errors:
        md += f"\n{len(errors)} episode(s) could not finish and will rerun on resume:\n" + "".join(f"- {e}\n" for e in errors[:20])
    if spend_table:
        md += f"\n## What the paid models cost\n\n{spend_table}\n"
    paths["markdown"].write_text(md)
    if rows:
        bar_chart(rows, paths["png"], title=f"{agent}")
    return paths
