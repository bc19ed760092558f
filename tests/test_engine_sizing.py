"""The engine's pool size from free memory (engine/sizing.py) and where the pool lives.

The arithmetic is checked on stated free-memory figures (CPU devices report no memory limit,
so `pages_for` takes the figure a device would report); the placement on a real 8-device CPU
mesh (tests/conftest.py)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import actionopd_jax.engine.programs as programs
from actionopd_jax.engine.sizing import EngineConfig, pages_for, pool_pages, pool_shards
from actionopd_jax.sampling.budget import SAFETY, cache_bytes_per_token
from actionopd_jax.testing.tiny_checkpoint import tiny_config

GIB = 2 ** 30


def test_pages_fill_what_is_free_less_the_reserve():
    cfg = tiny_config(num_key_value_heads=2)
    eng = EngineConfig(slots=4, page_size=16, max_len=256)
    page_bytes = cache_bytes_per_token(cfg, "bfloat16") * 16                 # one page of k and v, all layers
    free = 1.0 * GIB
    pages = pages_for(cfg, eng, free, dtype="bfloat16") - 1                  # less the null page
    assert pages * page_bytes <= free * SAFETY < (pages + 1) * page_bytes
    # a reserve for the trainer's update takes its own share (times SAFETY) off the pool
    reserved = pages_for(cfg, eng, free, dtype="bfloat16", reserve_bytes=0.25 * GIB) - 1
    assert reserved * page_bytes <= 0.75 * GIB * SAFETY < (reserved + 1) * page_bytes
    # KV heads split over 2 chips: each page costs each chip half as much
    assert pages_for(cfg, eng, free, shards=2, dtype="bfloat16") - 1 in (2 * pages, 2 * pages + 1)


def test_too_little_memory_for_one_slot_says_what_to_lower():
    cfg = tiny_config()
    eng = EngineConfig(slots=4, page_size=16, max_len=4096)
    with pytest.raises(ValueError, match="max_len"):
        pages_for(cfg, eng, 2 * GIB, reserve_bytes=2 * GIB - 1)


def test_pool_pages_without_a_memory_limit_and_when_given():
    cfg = tiny_config()
    eng = EngineConfig(slots=4, page_size=16, max_len=256)
    assert pool_pages(cfg, eng) == 2 * 4 * 16 + 1                  # CPU: every slot full, twice, + null page
    assert pool_pages(cfg, EngineConfig(slots=4, page_size=16, max_len=256, pages=40), reserve_bytes=GIB) == 40


def test_a_cpu_pool_for_the_models_whole_context_is_bounded_by_host_memory(monkeypatch):
    """Issue 43 item 2: eval and serve size the engine from the model's own context (Qwen3:
    40,960 tokens); every slot full twice over would be ~150 GB of cache for Qwen3-0.6B on
    CPU. The pool takes at most half of the host's available memory, and says so when one slot
    does not fit."""
    from actionopd_jax.engine import sizing
    from actionopd_jax.sampling.budget import cache_bytes_per_token

    cfg = tiny_config()
    eng = EngineConfig(slots=8, page_size=16, max_len=40_960)
    page = cache_bytes_per_token(cfg, "float32") * 16
    monkeypatch.setattr(sizing, "host_available_bytes", lambda: 10_000 * page)
    pages = pool_pages(cfg, eng)
    assert eng.pages_per_slot + 1 <= pages <= 5_000 + 1 < 2 * 8 * eng.pages_per_slot
    monkeypatch.setattr(sizing, "host_available_bytes", lambda: 1_000 * page)   # less than one slot's 2,560 pages
    with pytest.raises(ValueError, match="fewer than one slot.*--engine-max-len"):
        pool_pages(cfg, eng)


def test_the_pool_is_made_split_over_the_tensor_axis():
    cfg = tiny_config(num_key_value_heads=2)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tensor"))
    assert pool_shards(mesh, 2) == 2 and pool_shards(mesh, 3) == 1
    pool = programs.empty_pool(cfg, 9, 4, "float32", mesh)
    k = pool.k                                                      # every layer's pages in one array
    assert k.shape == (2, cfg.num_hidden_layers * 9, 4, cfg.head_dim)
    assert k.sharding.spec[0] == "tensor"
    assert {s.data.shape[0] for s in k.addressable_shards} == {1}   # one KV head per device
    assert float(abs(k).max()) == 0.0
