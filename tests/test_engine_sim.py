"""benchmarks/engine_sim.py (issues 38, 44): the decode step's cost model, hand-computed.

Pure Python (the replay imports no JAX): the prompt's KV read by every row (what programs.py
does on accelerators) or once a group (the option), the step on fewer chips, and the pool's
admission rule.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import engine_sim as E  # noqa: E402


def _args(*extra):
    return E.build_parser().parse_args(["--mean-decisions", "3", *extra])


def test_decode_step_reads_every_rows_prompt_unless_shared_and_scales_with_chips():
    args, shared = _args(), _args("--shared-prompt-read")
    # two groups running: prompts 1,000 and 3,000, 4 rows each, 50 tokens generated per row
    rows = 4 * (1000 + 50) + 4 * (3000 + 50)
    assert E.kv_read(rows, 4000, 16000, args) == 16400            # every row reads its prompt
    assert E.kv_read(rows, 4000, 16000, shared) == 4000 + 400     # each prompt once
    # 1.94 ms + (16,400 + 248 empty slots x 128) tokens x 147,456 B / (4 x 2,765 GB/s x 0.86)
    by_hand = 1.94e-3 + (16400 + 248 * 128) * 147456 / (4 * 2765e9 * 0.86)
    assert E.decode_step_seconds(16400, 248, args) == pytest.approx(by_hand, rel=1e-12)
    assert E.decode_step_seconds(16400, 248, args, chips=1) == pytest.approx(4 * by_hand, rel=1e-12)
    assert E.KV_TOKEN == 2 * 36 * 8 * 128 * 2


def test_shared_prompt_read_is_faster_and_default_unchanged_by_the_pool():
    work = E.draw_workload(np.random.default_rng(0), _args())
    today = E.run_engine(work, _args())
    assert E.run_engine(work, _args("--shared-prompt-read"))["wall"] < today["wall"]
    # the recipe's pool (1.8M tokens) never binds this small workload: a pool of 10x gives the same run
    assert E.run_engine(work, _args("--pool-tokens", "1.8e7")) == today


def test_pool_admits_a_state_only_with_its_worst_case_free():
    work = E.draw_workload(np.random.default_rng(0), _args())
    biggest = max(p for t in work for p, _ in E.prompts_of(t))
    assert biggest < E.N * E.MAX_NEW          # so two states' worst cases never fit that pool
    one = E.run_engine(work, _args("--pool-tokens", str(E.reservation(biggest))))
    # room for one state at a time: at most N of the 256 slots ever run
    assert one["util"] <= E.N / 256 + 1e-12
    assert E.reservation(1000) == 1000 + 4 * 4096
    with pytest.raises(RuntimeError, match="pool tokens"):
        E.run_engine(work, _args("--pool-tokens", str(E.reservation(biggest) - 1)))
