"""The table logic of benchmarks/execution_step.py (issue 45's collection-step measurement):
pairs per deciding stage from the matcher's counters, judge calls per step on against off,
fork percentiles per pool, and the student's rewrites. No collection runs here (the benchmark
itself does that); these are the pure pieces that turn its rows into the reported numbers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from actionopd_jax.matching.matcher import MatcherStats
from actionopd_jax.types import ToolCall

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("execution_step", ROOT / "benchmarks" / "execution_step.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _row(mode, wall, fork_s=(), **stats):
    s = MatcherStats(**stats).as_dict()
    row = bench.stage_counts(s)
    row.update(mode=mode, wall_s=wall, fork_s=list(fork_s), fork_s_by_env={"awm": list(fork_s)} if fork_s else {})
    return row


def test_stage_counts_split_every_pair_into_rules_execution_and_judge():
    c = bench.stage_counts(MatcherStats(pairs=20, invalid_or_cross_kind=6, name_mismatch=2, programmatic_match=3,
                                        execution_match=4, execution_no_match=2, judge_calls=1, judge_reused=2,
                                        judge_calls_saved=3, execution_forks=5).as_dict())
    assert (c["rules"], c["execution"], c["judge"]) == (11, 6, 3)
    assert (c["saved"], c["forks"], c["judge_calls"]) == (3, 5, 1)


def test_table_reports_calls_saved_per_step_and_fork_percentiles():
    rows = [_row("off", 2.0, pairs=12, invalid_or_cross_kind=4, judge_calls=8),
            _row("off", 4.0, pairs=12, invalid_or_cross_kind=4, judge_calls=4),
            _row("auto", 5.0, fork_s=(0.1, 0.2, 0.3), pairs=12, invalid_or_cross_kind=4, execution_match=6,
                 judge_calls=2, judge_calls_saved=4, execution_forks=3),
            _row("auto", 7.0, fork_s=(0.5, 0.4), pairs=12, invalid_or_cross_kind=4, execution_no_match=8,
                 judge_calls_saved=2, execution_forks=2)]
    text = bench.table(rows)
    off, auto = (next(line.split() for line in text.splitlines() if line.startswith(m + " ")) for m in ("off", "auto"))
    assert off[1:6] == ["2", "24", "8", "0", "16"] and off[6] == "6.0" and off[-1] == "3.00"
    assert auto[1:6] == ["2", "24", "8", "14", "2"] and auto[6:9] == ["1.0", "3.0", "5"] and auto[-1] == "6.00"
    assert auto[9:11] == ["300.0", "500.0"]  # p50 / p99 (nearest rank) of the five fork runs, in ms
    assert "forks on awm: 5, p50 300.0 ms, p99 500.0 ms" in text
    assert "off 6.0 -> auto 1.0 (83% saved)" in text and "off 3.00 s -> auto 6.00 s (+3.00 s)" in text


def test_the_scripted_student_rewrites_case_and_puts_one_argument_off():
    call = ToolCall("search_books", {"title_query": "Dune", "limit": 3, "exact": True})
    assert bench.rewritten(call) == ToolCall("search_books", {"title_query": "dune", "limit": 3, "exact": True})
    assert bench.one_off(call).arguments == {"title_query": "Dune X", "limit": 3, "exact": True}
    assert bench.one_off(ToolCall("f", {"flag": False, "n": 2})).arguments == {"flag": False, "n": 3}
