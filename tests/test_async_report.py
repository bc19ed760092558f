"""The asynchronous collection report (train/async_report.py, issue 44): hand-built
metrics.jsonl lines, as a run at collect.max_staleness=1 writes them, give the hand-computed
table; a synchronous run's metrics give no report."""

import json

from actionopd_jax.train.async_report import ages, async_history, async_table, write_async_report


def _line(step, **asy):
    return json.dumps({"step": step, "loss": 0.1, **{f"collect/async/{k}": v for k, v in asy.items()}})


def test_the_report_sums_ages_drops_and_waits_and_a_synchronous_run_writes_none(tmp_path):
    lines = [
        _line(1, max_staleness=1, staleness_0=6, staleness_1=0, stale_dropped=0, wait_s=3.0, swap_wait_s=0.0,
              sampler_busy_frac=0.5, teacher_in_flight=2, trajectories_in_flight=4),
        _line(2, max_staleness=1, staleness_0=1, staleness_1=5, stale_dropped=1, wait_s=0.5, swap_wait_s=0.25,
              sampler_busy_frac=0.9, teacher_in_flight=4, trajectories_in_flight=8),
        '{"step": 3, "collect/async/wait_s": 1.',   # cut by a kill: skipped
        _line(2, max_staleness=1, staleness_0=2, staleness_1=4, stale_dropped=2, wait_s=1.0, swap_wait_s=0.5,
              sampler_busy_frac=0.7, teacher_in_flight=6, trajectories_in_flight=6),   # step 2 again after a resume
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    history = async_history(tmp_path / "metrics.jsonl")
    assert [h["step"] for h in history] == [1.0, 2.0]
    assert ages(history) == [8.0, 4.0]   # 6 + 2 fresh, 0 + 4 one update old (the resumed step's line)
    table = async_table(history)
    assert "| groups trained at staleness 0 | 8 (67%) |" in table
    assert "| groups trained at staleness 1 | 4 (33%) |" in table
    assert "| groups dropped (older than 1) | 2 |" in table
    assert "| update waited for data | 4.0 s (2.00 s a step) |" in table
    assert "| rollout waited for weights | 0.5 s (0.25 s a step) |" in table
    assert "| sampler busy | 60% of the wall clock (mean of steps) |" in table
    assert "| teacher requests in flight | 4.0 (mean at a step's end) |" in table
    out = write_async_report(tmp_path)
    assert out["markdown"].read_text().count(table) == 1 and out["png"].stat().st_size > 0

    sync = tmp_path / "sync"
    sync.mkdir()
    (sync / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1, "collect/match_rate": 0.5}) + "\n")
    assert write_async_report(sync) == {"table": ""}
    assert not (sync / "async.md").exists()
