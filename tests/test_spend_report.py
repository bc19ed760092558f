"""Issue 35 item 1: what the paid models cost, read back from metrics.jsonl: the table per role,
the cumulative plot, the progress bar's field. Numbers are hand-made meter totals."""

from __future__ import annotations

import json

from actionopd_jax.train.spend_report import progress_fields, spend_history, spend_table, write_spend_report


def _line(step: int, teacher_usd: float, judge_usd: float | None, tokens: int) -> str:
    rec = {"step": step, "loss": 0.1}
    for role, usd in (("teacher", teacher_usd), ("matcher", judge_usd), ("user", None)):
        rec.update({f"collect/{role}/requests_total": 10 * step, f"collect/{role}/cache_hits_total": step,
                    f"collect/{role}/prompt_tokens_total": tokens * step, f"collect/{role}/completion_tokens_total": step})
        if usd is not None:
            rec[f"collect/{role}/spend_usd_total"] = usd
    return json.dumps(rec)


def test_the_spend_table_reads_the_last_totals_of_every_role_and_adds_the_priced_ones(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [_line(1, 0.5, 0.25, 1000), _line(2, 1.0, 0.5, 1000),
             _line(2, 1.25, 0.75, 1000),           # a resumed run logged step 2 again: the last line counts
             '{"step": 3, "collect/teach']         # a line cut by a kill
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    history = spend_history(run / "metrics.jsonl")
    assert [h["step"] for h in history] == [1.0, 2.0] and history[-1]["teacher/spend_usd_total"] == 1.25
    table = spend_table(history)
    assert "| teacher | 20 | 2 | 2,000 | 2 | $1.2500 |" in table
    assert "| judge (matcher) | 20 | 2 | 2,000 | 2 | $0.7500 |" in table
    assert "| user simulator | 20 | 2 | 2,000 | 2 | no price set |" in table
    assert "| **total** | | | | | **$2.0000** |" in table
    report = write_spend_report(run)
    assert report["png"].read_bytes()[:4] == b"\x89PNG" and table in report["markdown"].read_text()


def test_nothing_metered_writes_nothing_and_the_progress_field_follows_the_price(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.2}) + "\n")
    assert write_spend_report(tmp_path) == {"table": ""} and not (tmp_path / "spend.md").exists()
    assert progress_fields({"collect/spend_usd_total": 12.345}) == {"spent": "$12.35"}
    assert progress_fields({"collect/teacher/prompt_tokens_total": 1_500_000.0,
                            "collect/teacher/completion_tokens_total": 500_000.0}) == {"teacher_tok": "2.00M"}
    assert progress_fields({"loss": 1.0}) == {}
