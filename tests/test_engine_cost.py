"""The engine's programs update the page pool in place, by the compiler's own analyses
(benchmarks/engine_cost.py, which reports them at Qwen3-4B's shapes): compiled for the CPU on
the accelerator path (the layer scan a GPU runs), the decode segment and the fresh-prompt
prefill chunk alias the whole pool in and out (XLA's memory analysis), hold no copy of a
pool-shaped buffer (the optimized HLO), and one pass touches a small part of a large pool
(benchmarks/hlo_bytes.py's walk, where XLA's own "bytes accessed" counts each row scatter as
the whole pool)."""

import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import engine_cost  # noqa: E402
from hlo_bytes import instruction_bytes  # noqa: E402
from actionopd_jax.engine.sizing import EngineConfig  # noqa: E402
from actionopd_jax.model.config import PRESETS  # noqa: E402
from actionopd_jax.model.sharding import make_mesh  # noqa: E402

PAGES = 4000     # far more than the 4 slots' 16 pages: a whole-pool read or copy stands out


def test_decode_and_fresh_prefill_update_the_pool_in_place():
    cfg = PRESETS["tiny"].replace(param_dtype="float32")
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    shapes = EngineConfig(slots=4, page_size=16, max_len=64, chunk=16, prefill_lanes=4, segment=4)
    for which, fresh in (("segment", False), ("chunk", True)):
        compiled, shape = engine_cost.engine_compile(cfg, mesh, shapes, "gather", 1, which, fresh=fresh, pages=PAGES)
        pool_bytes = 2 * 4 * shape[0] * shape[1] * shape[2] * shape[3]        # k and v, float32
        c = engine_cost.cost(compiled)
        assert c["alias"] >= pool_bytes, (which, c["alias"], pool_bytes)    # donated and aliased in place
        assert engine_cost.shape_copies(compiled, shape, "f32") == 0, which
        assert c["walk"] < pool_bytes / 4, (which, c["walk"], pool_bytes)   # the rows written, not the pool
        largest, name = instruction_bytes(compiled.as_text())[0]
        assert largest < pool_bytes / 8, (which, name, largest)           # no instruction touches a whole pool array
        if which == "segment":
            # XLA's own count charges the decode's row scatter as the whole pool: why the walk
            # exists. (The chunk's count depends on the CPU emitter, which the suite's compile
            # flags change: tests/_subprocess_fixtures.py.)
            assert c["bytes"] > pool_bytes, (which, c["bytes"])


def test_the_walk_follows_a_conditionals_cheapest_branch_when_asked():
    """A `lax.cond` runs one branch: "all" charges both (an upper figure), "cheapest" the small
    one, the common path of the engine's rare fallbacks (the full-vocabulary chooser)."""
    import jax.numpy as jnp

    from hlo_bytes import program_bytes

    big = jax.ShapeDtypeStruct((1 << 20,), jnp.float32)          # 4 MiB read by the rare branch only

    def f(x, table):
        return jax.lax.cond(x[0] > 0, lambda: x * 2.0, lambda: x + table[:8].sum() * jnp.exp(table).sum())

    text = jax.jit(f).lower(jax.ShapeDtypeStruct((8,), jnp.float32), big).compile().as_text()
    every, common = program_bytes(text), program_bytes(text, branches="cheapest")
    assert every > 4 * 2**20 > 4096 > common, (every, common)


def test_the_walk_counts_an_asynchronous_fusion_once_as_the_fusion_it_runs():
    """jaxlib 0.11's XLA:GPU starts a scanned trip's weight slice as an asynchronous fusion:
    the walk counts the slice it reads and writes (2 x 4 MiB), not the whole stack its start
    takes (64 MiB; 68 MiB counted before the walk knew the pair)."""
    from hlo_bytes import program_bytes

    text = """HloModule m, entry_computation_layout={(f32[16,1024,1024]{2,1,0}, s32[])->f32[1,1024,1024]{2,1,0}}

%fused_dynamic_slice (param_0: f32[16,1024,1024], param_1: s32[]) -> f32[1,1024,1024] {
  %param_0 = f32[16,1024,1024]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %constant.0 = s32[] constant(0)
  ROOT %dynamic-slice.0 = f32[1,1024,1024]{2,1,0} dynamic-slice(%param_0, %param_1, %constant.0, %constant.0), dynamic_slice_sizes={1,1024,1024}
}

ENTRY %main (stack: f32[16,1024,1024], i: s32[]) -> f32[1,1024,1024] {
  %stack = f32[16,1024,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %fusion-start.0 = ((f32[16,1024,1024]{2,1,0}, s32[]), f32[1,1024,1024]{2,1,0}, u32[]) fusion-start(%stack, %i), kind=kLoop, calls=%fused_dynamic_slice
  ROOT %fusion-done.0 = f32[1,1024,1024]{2,1,0} fusion-done(%fusion-start.0)
}
"""
    got = program_bytes(text)
    assert 2 * 4 * 2**20 <= got <= 2 * 4 * 2**20 + 4, got       # (+ the s32 index)


def test_the_static_samplers_layer_scan_writes_its_generated_cache_in_place():
    """The static sampler's decode step (accelerator path) with its layers unrolled, as the cost
    model compiles it, copies the generated cache: a layer's attention read is not ordered
    before the step's in-place write. The layer scan the sampler runs has no such copy, so
    engine_cost leaves those copies' bytes (copies_walk) out of static's figure."""
    cfg = PRESETS["tiny"].replace(param_dtype="float32")
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    unrolled, shape = engine_cost.static_compile(cfg, mesh, 2, 2, "decode")
    scanned, _ = engine_cost.static_compile(cfg, mesh, 2, 2, "decode", layer_unroll=1)
    assert engine_cost.shape_copies(scanned, shape, "f32") == 0
    n = engine_cost.shape_copies(unrolled, shape, "f32")
    buffer = 4 * int(np.prod(shape))
    assert n > 0 and engine_cost.copies_walk(unrolled, shape, "f32") == 2 * n * buffer   # each read and written once
