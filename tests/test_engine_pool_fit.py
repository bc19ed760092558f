"""Issue 41 goal 3: an "auto" pool is sized from the free memory less what the engine's own
compiled programs need beside their arguments, read from XLA's memory analysis before the
pool is allocated (engine/pool_fit.py, sizing.fit_pages), not from a fixed fraction alone.

CPU devices report no memory limit, so the free figure a GPU would report is stated
(budget.free_bytes_per_chip replaced); the programs are really compiled on this CPU and their
memory analysis is XLA's own."""

import re

import pytest

import jax
import numpy as np

import actionopd_jax.sampling.budget as budget_lib
from _engine_fixtures import assert_same, engine, reference
from actionopd_jax.engine.pool_fit import ProgramNeeds, engine_needs
from actionopd_jax.engine.sizing import fit_pages, pages_for
from actionopd_jax.sampling.budget import SAFETY, cache_bytes_per_token


def test_an_auto_pool_leaves_the_programs_their_own_memory_and_refuses_what_cannot_fit(monkeypatch):
    probe = engine()                              # the shared shapes, a fixed pool (nothing compiled yet)
    page = cache_bytes_per_token(probe.cfg, str(probe.dtype)) * probe.config.page_size
    free = 600 * page
    monkeypatch.setattr(budget_lib, "free_bytes_per_chip", lambda mesh=None: free)
    eng = engine(pages="auto")
    assert eng.pool is None                       # sized before anything is allocated
    needs = {n.kind: n for n in eng.pool_needs}
    assert set(needs) == {"prefill chunk", "decode segment"}
    for n in needs.values():                      # XLA's analysis: scratch beyond the arguments, the pool donated
        assert n.temp > 0 and n.argument > 0 and n.beside_arguments >= n.temp
    beside = max(n.beside_arguments for n in needs.values())
    pages = eng.total_pages - 1                   # less the null page
    assert pages * page + beside <= free and pages * page <= (free - beside) * SAFETY < (pages + 1) * page
    old = pages_for(eng.cfg, eng.config, free, dtype=str(eng.dtype)) - 1   # the fixed fraction alone
    assert old - pages >= int(beside * SAFETY // page) - 1 > 0
    # the fitted pool runs: the prefill chunk compiled against an abstract pool of its size is
    # the one the run finds (not compiled again), and the tokens are the static sampler's
    engine_needs(eng, eng.total_pages)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, size=n).astype(np.int32) for n in (9, 21)]
    settings = dict(n=[2, 2], max_new_tokens=[6, 6], temperature=[0.8] * 2, top_p=[1.0] * 2, top_k=[0] * 2)
    keys = [jax.random.key(40 + i) for i in range(2)]
    assert_same(eng.sample(prompts, key=keys, **settings).generations, reference(prompts, keys, **settings))
    assert [k for k, _ in eng.compile_stats.shapes].count("chunk") == 2      # sizing at 2 pool sizes, none after
    # a device whose free memory holds one slot by the fixed fraction but not beside the
    # programs: refused at sizing, with the numbers (XLA's figures named), not out of memory later
    one_slot = eng.config.pages_per_slot
    tight = beside + (one_slot - 4) * page / SAFETY
    assert pages_for(eng.cfg, eng.config, tight, dtype=str(eng.dtype)) - 1 >= one_slot
    with pytest.raises(ValueError, match=r"decode segment program needs .* beside its arguments \(XLA's memory "
                                         r"analysis: temporaries .*fewer than one slot's 16: lower the engine's"):
        fit_pages(page, tight, reserve_bytes=0, needs=list(needs.values()), min_pages=one_slot + 1)


def test_fit_pages_takes_the_largest_need_and_the_reserve_off_first():
    gib = 2 ** 30
    needs = [ProgramNeeds("prefill chunk", 0, 0, 0, 3 * gib, 0), ProgramNeeds("decode segment", 0, 5 * gib, 4 * gib,
                                                                             gib, 0)]
    assert [n.beside_arguments for n in needs] == [3 * gib, 2 * gib]   # outputs in place of the donated pool are free
    mib = 2 ** 20
    assert fit_pages(mib, 20 * gib, reserve_bytes=7 * gib, needs=needs, min_pages=2, safety=1.0) == 10 * 1024 + 1
    with pytest.raises(ValueError, match=r"20\.00 GiB free per chip, 18\.00 GiB of it kept for the trainer; the "
                                         r"prefill chunk program needs 3\.00 GiB"):
        fit_pages(mib, 20 * gib, reserve_bytes=18 * gib, needs=needs, min_pages=2, safety=1.0)


def test_check_says_with_the_numbers_when_the_pool_cannot_hold_one_slot():
    """`train --check` (train/plan.py) for the engine on a device too small for the 4B recipe
    beside one slot's pages: the plan names each figure, and that the programs' scratch comes
    off the pool at start from XLA's analysis."""
    from pathlib import Path

    from actionopd_jax.config.load import load_config
    from actionopd_jax.train.plan import GIB, _engine_lines, estimate_collection, estimate_memory
    from actionopd_jax.train.setup import model_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/paper/qwen3_4b_h200.yaml",
                      ["collect.sampler=engine", "model.preset=qwen3-4b", "model.hf_path="])   # no checkpoint here
    qcfg, mesh = model_config(cfg), {"data": 1, "fsdp": 1, "tensor": 1}
    usable = 54 * GIB
    est = estimate_memory(cfg, qcfg, mesh, "cudnn")
    coll = estimate_collection(cfg, qcfg, mesh, chips_per_host=1, usable_bytes=usable, platform="gpu")
    pages, _, lines = _engine_lines(cfg, qcfg, mesh, coll, est, usable)
    text = "\n".join(lines)
    assert pages == 0 and "XLA's memory analysis of the chunk and segment programs" in text
    assert re.search(r"the pool does not hold one slot: 54\.00 GiB usable .* leaves -?[\d.]+ GiB, x 0\.85 = 0 pages "
                     r"of 2\.25 MiB; one slot of 28,672 tokens needs 1,792 \(3\.94 GiB\)", text), text
