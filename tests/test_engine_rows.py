"""The CPU engine's segment rows (engine/groups.py): a segment runs only as many rows as hold
its running slots, laid out in blocks whose samples share their prompt's pages; the layout
never changes a sample (the static sampler's tokens), and it is the one described."""

import types

import jax
import numpy as np

from _engine_fixtures import assert_same, engine, reference
from actionopd_jax.engine.groups import arrange, compact_rows
from actionopd_jax.engine.pages import NULL_PAGE
from actionopd_jax.engine.programs import SHARE_WIDTH, row_buckets
from actionopd_jax.engine.sizing import EngineConfig


def test_row_buckets_and_compaction():
    assert row_buckets(32) == (4, 8, 16, 32)
    assert row_buckets(6) == (4, 6)
    assert row_buckets(3) == (3,)
    running = {9: "a", 2: "b", 30: "c"}
    rows = compact_rows(running, 32)
    assert rows.tolist() == [2, 9, 30, 0]             # running first, then the first idle slot
    assert compact_rows({s: "x" for s in range(5)}, 32).tolist() == list(range(8))


def _request(rid, prompt_len, pages):
    return types.SimpleNamespace(rid=rid, prompt=np.zeros(prompt_len, np.int32), prompt_pages=pages)


def test_arrange_blocks_share_prompts_and_singles_fill_the_rest():
    config = EngineConfig(slots=8, page_size=4, max_len=32)            # 8 pages per slot
    a = _request(0, 9, [1, 2, 3])                                      # 2 whole pages + a partial one
    b = _request(1, 8, [4, 5])
    c = _request(2, 2, [6])                                            # no whole page: nothing to share
    d = _request(3, 12, [7, 8, 9])
    running = {0: (a, 0), 1: (a, 1), 2: (a, 2), 3: (b, 0), 4: (c, 0), 5: (c, 1), 6: (d, 0), 7: (d, 1)}
    table = np.arange(8 * 8, dtype=np.int32).reshape(8, 8) + 100
    rows, groups = arrange(running, table, config)
    assert sorted(rows.tolist()) == list(range(8))                     # every running slot, once
    assert groups.table.shape[0] == 8 // SHARE_WIDTH == 2
    # a's three samples and d's two are chunks: the larger first; b (one sample) and c (no
    # whole page) are singles, in the free rows
    assert rows[:3].tolist() == [0, 1, 2] and rows[4:6].tolist() == [6, 7]
    assert groups.length.tolist() == [8, 12]
    assert groups.table[0, :2].tolist() == [1, 2] and groups.table[1, :3].tolist() == [7, 8, 9]
    assert (groups.table[0, 2:] == NULL_PAGE).all()
    assert groups.own_start.tolist()[:3] == [8, 8, 8] and groups.own_start.tolist()[4:6] == [12, 12]
    for r in (3, 6, 7):                                                # singles: the whole table
        assert groups.own_start[r] == 0
        assert groups.own_table[r].tolist() == table[rows[r]].tolist()
    # a sharing row's own pages: its table past the shared ones
    assert groups.own_table[1, :6].tolist() == table[1, 2:].tolist() and (groups.own_table[1, 6:] == NULL_PAGE).all()


def test_more_chunks_than_blocks_become_singles():
    config = EngineConfig(slots=8, page_size=4, max_len=32)
    reqs = [_request(i, 8, [2 * i + 1, 2 * i + 2]) for i in range(4)]
    running = {2 * i + j: (reqs[i], j) for i in range(4) for j in range(2)}
    rows, groups = arrange(running, np.zeros((8, 8), np.int32), config)
    assert sorted(rows.tolist()) == list(range(8))
    assert (groups.length > 0).sum() == 2                              # two blocks, four chunks of two
    assert (groups.own_start > 0).sum() == 4


def test_two_sample_states_in_a_small_engine_give_the_static_samples():
    """Many two-sample states in 8 slots: chunks outnumber blocks, rows shrink as states end
    (programs of 4 and 8 rows), and the tokens are the static sampler's."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, size=int(rng.integers(5, 30))).astype(np.int32) for _ in range(7)]
    settings = dict(n=[2] * 7, max_new_tokens=[int(rng.integers(3, 20)) for _ in prompts],
                    temperature=[0.8] * 7, top_p=[1.0] * 7, top_k=[0] * 7)
    keys = [jax.random.key(300 + i) for i in range(7)]
    want = reference(prompts, keys, **settings)
    eng = engine(3, slots=8)
    ran, run = [], eng._run
    eng._run = lambda kind, *a, **k: (ran.append(kind), run(kind, *a, **k))[1]
    got = eng.sample(prompts, key=keys, **settings).generations
    assert_same(got, want)
    segments = [kind for kind in ran if kind != "chunk"]
    assert set(segments) == {"segment4", "segment8"}, segments


def test_the_batch_api_prefills_every_admitted_prompt_before_its_first_segment(monkeypatch):
    """`sample` (run_ahead: nothing more is submitted) prefills every prompt it admitted before
    it decodes, here 3 prompts with one chunk call a step: on an accelerator a segment computes
    every slot, so a first segment over 1 prompt's rows would pay for all 6 slots. The samples
    stay the static sampler's."""
    import actionopd_jax.engine.engine as engine_module

    eng = engine(chunks_per_step=1, prefill_lanes=1)
    started = []
    real = engine_module.start_samples

    def spy(starting, *args, **kwargs):
        started.append(len(starting))
        return real(starting, *args, **kwargs)

    monkeypatch.setattr(engine_module, "start_samples", spy)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(20, 200, size=n).astype(np.int32) for n in (9, 5, 12)]
    keys = [jax.random.key(40 + i) for i in range(3)]
    settings = dict(n=[2, 2, 2], max_new_tokens=[5, 5, 5], temperature=[1.0, 1.0, 1.0], top_p=[1.0] * 3, top_k=[0] * 3)
    got = eng.sample(prompts, key=keys, **settings).generations
    assert started[0] == 3, started          # all three prompts' samples start in the first segment
    assert_same(got, reference(prompts, keys, **settings))
