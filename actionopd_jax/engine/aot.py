"""The engine's programs lowered ahead of time (no device, nothing allocated), as the engine
compiles them: the prefill chunk and the decode segment of engine/programs.py at the run's
fixed shapes (EngineConfig), over abstract sharded parameters and an abstract page pool.

`train --check` on a GPU target lowers them for CUDA when the run collects with the engine
(`collect.sampler: engine`), and tests/test_cuda_lowering.py checks the Triton kernel of the
paged switch's "paged_gpu" backend is in them, and not in the chunk program for lanes that all
start a prompt (programs.FRESH_PREFILL: the model's causal attention)."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from actionopd_jax.aot.compile import CompileReport, compile_for
from actionopd_jax.aot.lowering import LoweringReport, cuda_stand_in, lower_for
from actionopd_jax.engine import programs
from actionopd_jax.engine.sizing import EngineConfig, engine_attention
from actionopd_jax.model.attention.paged_tpu import tensor_split
from actionopd_jax.sampling.aot import abstract_model
from actionopd_jax.sampling.token_choice import DEFAULT_CAP

TRITON = "triton"  # a substring of the custom call the Pallas GPU kernel lowers to


def engine_shapes(collect) -> EngineConfig:
    """The engine's shapes for a run's `collect` section (config/schema.CollectConfig), as
    collect/source.build_engine gives them: a slot holds the longest prompt plus a reply;
    slots default to concurrency x candidates."""
    c = collect
    return EngineConfig(slots=c.engine_slots or c.concurrency * c.num_candidates, page_size=c.engine_page_size,
                        max_len=c.max_prompt_tokens + c.max_response_tokens, segment=c.engine_segment,
                        chunk=min(512, c.max_prompt_tokens), attention=c.engine_attention)


def abstract_pool(cfg, mesh, pages: int, page_size: int, dtype=jnp.bfloat16) -> programs.Pool:
    """The engine's own pool (programs.empty_pool, whatever its layout) as abstract arrays,
    KV heads (axis 0) over "tensor" where it divides them (the kernels' split)."""
    pool = jax.eval_shape(lambda: programs.empty_pool(cfg, pages, page_size, dtype))
    sharding = NamedSharding(mesh, P(tensor_split(mesh, cfg.num_key_value_heads)))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), pool)


def abstract_slots(cfg, mesh, slots: int, pages_per_slot: int, dtype=jnp.bfloat16) -> programs.Slots:
    rep = NamedSharding(mesh, P())
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731
    i32, f32, b = (lambda: sds((slots,), jnp.int32)), (lambda: sds((slots,), jnp.float32)), \
        (lambda: sds((slots,), jnp.bool_))
    return programs.Slots(table=sds((slots, pages_per_slot), jnp.int32), lengths=i32(), last=i32(), step=i32(),
                          done=b(), stopped=b(), key_data=sds((slots, 2), jnp.uint32), temperature=f32(), top_k=i32(),
                          top_p=f32(), max_new=i32(), fresh=b(), fresh_hidden=sds((slots, cfg.hidden_size), dtype))


def _engine_programs(cfg, mesh, shapes: EngineConfig, impl: str, *, runtime, head: str, cap: int,
                     label: str) -> list[tuple[str, object, tuple]]:
    """(label, jitted program, abstract arguments) of the engine's prefill chunk, decode segment
    and, where the backend has one, its fresh-prompt chunk: bfloat16 weights and pool."""
    graphdef, params = abstract_model(cfg.replace(param_dtype="bfloat16"), mesh, runtime)
    pps = shapes.pages_per_slot
    pages = shapes.pages if isinstance(shapes.pages, int) else shapes.slots * pps + 1
    pool = abstract_pool(cfg, mesh, pages, shapes.page_size)
    rep = NamedSharding(mesh, P())
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=rep)  # noqa: E731
    what = label or f"{shapes.slots} slots x {shapes.max_len:,} tokens, pages of {shapes.page_size}, {impl}"
    segment = jax.jit(functools.partial(programs.segment, steps=shapes.max_segment, page_size=shapes.page_size, cap=cap,
                                        head=head, backend="accelerator", attention=impl),
                      static_argnums=(0,), donate_argnums=(3,))
    chunk = jax.jit(functools.partial(programs.prefill_chunk, page_size=shapes.page_size, attention=impl),
                    static_argnums=(0,), donate_argnums=(2,))
    lanes = shapes.prefill_lanes
    blocks = shapes.slots // programs.SHARE_WIDTH      # the engine's prompt sharing, where its backend shares
    groups = programs.Groups(table=i32(blocks, pps), length=i32(blocks), own_start=i32(shapes.slots),
                             own_table=i32(shapes.slots, pps)) if impl in programs.SHARED_ATTENTION else None
    chunk_args = (graphdef, params, pool, i32(lanes, shapes.chunk), i32(lanes), i32(lanes), i32(lanes, pps))
    found = [(f"engine prefill chunk ({what})", chunk, chunk_args),
             (f"engine decode segment ({what})", segment,
              (graphdef, params, None, pool, abstract_slots(cfg, mesh, shapes.slots, pps), i32(shapes.slots),
               i32(shapes.slots), i32(2), groups, i32(), i32()))]
    if impl in programs.FRESH_PREFILL:
        # chunks whose lanes all start a prompt: the model's causal attention, never the kernel
        fresh = jax.jit(functools.partial(programs.prefill_chunk, page_size=shapes.page_size, attention=impl,
                                          fresh=True), static_argnums=(0,), donate_argnums=(2,))
        found.append((f"engine fresh-prompt chunk ({what})", fresh, chunk_args))
    return found


def lower_engine_programs(cfg, mesh, shapes: EngineConfig, *, attention: str = "auto", runtime=None,
                          head: str = "checked", cap: int = DEFAULT_CAP, platform: str = "cuda",
                          label: str = "") -> list[LoweringReport]:
    """Lower the engine's prefill chunk and decode segment for `platform` over `mesh`
    (bfloat16 weights and pool, the accelerator backend). `attention`: the engine's paged
    setting, resolved for the platform; a resolved GPU kernel whose Triton call is missing
    from a lowered program is reported as an error (the kernel was not what ran)."""
    traced_for = "gpu" if platform in ("cuda", "rocm") else platform
    impl = engine_attention(attention, traced_for, "accelerator")   # ragged_tpu refused, as the engine does
    reports = [lower_for(jitted, args, label=what, platform=platform, mesh=mesh, traced_for=traced_for)
               for what, jitted, args in _engine_programs(cfg, mesh, shapes, impl, runtime=runtime, head=head,
                                                          cap=cap, label=label)]
    for r in reports:
        fresh = "fresh-prompt" in r.label
        if impl == "paged_gpu" and r.ok and not fresh and not any(TRITON in c for c in r.custom_calls):
            r.ok, r.error = False, "engine attention is paged_gpu but the lowered program has no Triton call"
        if fresh and r.ok and any(TRITON in c for c in r.custom_calls):
            r.ok, r.error = False, "the fresh-prompt chunk runs the decode kernel (one kernel row per prompt token)"
    return reports


def compile_engine_programs(cfg, mesh, shapes: EngineConfig, *, attention: str = "auto", runtime=None,
                            head: str = "checked", cap: int = DEFAULT_CAP, label: str = "") -> list[CompileReport]:
    """The same programs compiled for `mesh`'s devices (a GPU target's compile-only devices,
    aot/gpu_topology.py, or this host's): XLA's memory analysis of each, nothing allocated. What
    one needs beside its arguments (temporaries, code, outputs not written in place) is what
    the pool must leave free (engine/pool_fit.py)."""
    platform = mesh.devices.flat[0].platform
    impl = engine_attention(attention, platform, "accelerator")
    with cuda_stand_in() if platform == "gpu" else contextlib.nullcontext():
        return [compile_for(jitted, args, label=what, mesh=mesh)
                for what, jitted, args in _engine_programs(cfg, mesh, shapes, impl, runtime=runtime, head=head,
                                                           cap=cap, label=label)]


__all__ = ["abstract_pool", "abstract_slots", "compile_engine_programs", "engine_shapes", "lower_engine_programs"]
