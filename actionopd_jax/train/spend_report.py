"""What the paid models cost a run, read back from its metrics.jsonl (the spend meters'
totals, collect/spend.py): a table per role, a cumulative plot, the progress line's field.

Written at the end of every training run (`spend.md` + `spend.png` in the run directory,
the table printed) and shown in the main job's report.md. Money appears where the role has a
price; tokens and requests always.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

ROLES = (("teacher", "teacher"), ("matcher", "judge (matcher)"), ("user", "user simulator"))
FIELDS = ("requests_total", "cache_hits_total", "prompt_tokens_total", "cached_prompt_tokens_total",
          "completion_tokens_total", "spend_usd_total")


def rows_by_step(metrics_jsonl: str | Path, row_of: Callable[[dict], dict[str, float]]) -> list[dict[str, float]]:
    """{"step", **row_of(line)} for each logged step whose line gives a row (an empty row skips
    it), in step order. A resumed run appends to the same file; a step logged twice keeps its
    last line; a line cut by a kill is skipped."""
    path = Path(metrics_jsonl)
    if not path.is_file():
        return []
    by_step: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue   # a line cut by a kill
        row = row_of(rec)
        if row and isinstance(rec.get("step"), (int, float)):
            by_step[int(rec["step"])] = {"step": float(rec["step"]), **row}
    return [by_step[s] for s in sorted(by_step)]


def spend_history(metrics_jsonl: str | Path) -> list[dict[str, float]]:
    """One row per logged step that carries meter totals: {"step", "<role>/<field>"...}."""
    return rows_by_step(metrics_jsonl, lambda rec: {
        f"{role}/{f}": float(rec[f"collect/{role}/{f}"]) for role, _ in ROLES for f in FIELDS
        if isinstance(rec.get(f"collect/{role}/{f}"), (int, float))})


def spend_table(history: list[dict[str, float]], labels: dict[str, str] | None = None) -> str:
    """The run's totals per role, as markdown ("" when nothing was metered). `labels`: names
    for the roles where a command plays them otherwise (eval's agent is the "teacher" role)."""
    if not history:
        return ""
    last = history[-1]
    lines = ["| role | requests | cache hits | prompt tokens | completion tokens | spend |", "|---|---|---|---|---|---|"]
    total, priced = 0.0, False
    for role, label in ROLES:
        if f"{role}/requests_total" not in last:
            continue
        label = (labels or {}).get(role, label)
        usd = last.get(f"{role}/spend_usd_total")
        money = f"${usd:,.4f}" if usd is not None else "no price set"
        if usd is not None:
            total, priced = total + usd, True
        # the vendor's prompt cache (cheaper input), not ours (cache hits: never sent)
        cached = last.get(f"{role}/cached_prompt_tokens_total", 0.0)
        prompt = f"{last[f'{role}/prompt_tokens_total']:,.0f}" + (f" ({cached:,.0f} cached)" if cached else "")
        lines.append(f"| {label} | {last[f'{role}/requests_total']:,.0f} | {last[f'{role}/cache_hits_total']:,.0f} | "
                     f"{prompt} | {last[f'{role}/completion_tokens_total']:,.0f} | {money} |")
    if priced:
        lines.append(f"| **total** | | | | | **${total:,.4f}** |")
    return "\n".join(lines)


def plot_spend(history: list[dict[str, float]], path: Path) -> None:
    """Cumulative spend per priced role by step, or cumulative tokens when nothing costs money."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(h["step"]) for h in history]
    # money when some role costs something; tokens otherwise (nothing priced, or priced at zero
    # as the main job's embedded teacher: a flat $0 line would say nothing)
    priced = any(history[-1].get(f"{r}/spend_usd_total", 0.0) > 0 for r, _ in ROLES)
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for role, label in ROLES:
        if priced and f"{role}/spend_usd_total" in history[-1]:
            values = [h.get(f"{role}/spend_usd_total", 0.0) for h in history]
        elif not priced and f"{role}/requests_total" in history[-1]:
            values = [h.get(f"{role}/prompt_tokens_total", 0.0) + h.get(f"{role}/completion_tokens_total", 0.0)
                      for h in history]
        else:
            continue
        ax.plot(steps, values, marker="o", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("USD (cumulative)" if priced else "tokens (cumulative)")
    ax.set_title("spend of the paid models" if priced else "tokens of the remote models (no spend)", fontsize=10)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_spend_report(run_dir: str | Path) -> dict[str, Any]:
    """spend.md and spend.png in `run_dir` from its metrics.jsonl; returns {"table", paths}
    ({"table": ""} when the run metered nothing, e.g. a baseline without a remote teacher)."""
    run = Path(run_dir)
    history = spend_history(run / "metrics.jsonl")
    table = spend_table(history)
    if not table:
        return {"table": ""}
    md, png = run / "spend.md", run / "spend.png"
    plot_spend(history, png)
    md.write_text(f"# What the remote models cost: {run.name}\n\nTotals over {len(history)} logged step(s) "
                  f"(resumes included). Prompt tokens the vendor read from its prompt cache are priced at the cached rate "
                  f"(shown in brackets), the rest as input; cache hits are our own caches: never paid. run.budget_* "
                  f"is a hard cap: each request batch reserved its worst case first (paid_calls.py).\n\n{table}\n\n![spend](spend.png)\n")
    return {"table": table, "markdown": md, "png": png}


def progress_fields(metrics: dict[str, float]) -> dict[str, str]:
    """The progress bar's spend field: dollars so far when a role is priced, else the
    teacher's tokens so far (nothing for a source without meters)."""
    if "collect/async/wait_s" in metrics:   # asynchronous collection (issue 44): trained groups' ages, the wait
        ages = {k: v for k, v in metrics.items() if k.startswith("collect/async/staleness_")}
        stale = sum(v for k, v in ages.items() if not k.endswith("_0")) / max(sum(ages.values()), 1.0)
        return {"stale": f"{stale:.0%}", "wait": f"{metrics['collect/async/wait_s']:.1f}s",
                **progress_fields({k: v for k, v in metrics.items() if k != "collect/async/wait_s"})}
    if "collect/spend_usd_total" in metrics:
        return {"spent": f"${metrics['collect/spend_usd_total']:,.2f}"}
    tokens = metrics.get("collect/teacher/prompt_tokens_total", 0.0) + \
        metrics.get("collect/teacher/completion_tokens_total", 0.0)
    return {"teacher_tok": f"{tokens / 1e6:.2f}M"} if "collect/teacher/prompt_tokens_total" in metrics else {}


def ledger_table(ledger: Any, labels: dict[str, str] | None = None) -> str:
    """A command's paid calls outside training (eval with an endpoint, the screen, the summaries
    drafter: the ledger it installed, paid_calls.py) as the same table, for the roles that made
    a request ("" when none did)."""
    metrics = ledger.metrics()
    used = {r for r, _ in ROLES if metrics.get(f"{r}/requests_total", 0.0) > 0}
    row = {k: v for k, v in metrics.items() if k.split("/", 1)[0] in used}
    return spend_table([row], labels) if used else ""


def ledger_summary(ledger: Any, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """The same totals for a results file: per role (by its label) requests, tokens and USD
    where priced, and the priced total."""
    out: dict[str, Any] = {}
    for role, label in ROLES:
        t = ledger.totals[role]
        if t.requests:
            out[(labels or {}).get(role, label)] = {
                "requests": t.requests, "prompt_tokens": t.prompt_tokens,
                "cached_prompt_tokens": t.cached_prompt_tokens, "completion_tokens": t.completion_tokens, **({"usd": t.spend_usd} if ledger.prices.get(role) else {})}
    if out and any(ledger.prices.values()):
        out["total_usd"] = ledger.spend_usd
    return out
