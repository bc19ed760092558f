"""The page pool sized from the device's free memory less the engine's own programs' needs.

An "auto" pool used to take budget.SAFETY (85%) of what was free, leaving the compiled
programs' scratch to fit in the other 15%. At 256 slots of Qwen3-4B on the H200 it did not
(2026-12-04, run 1: out of memory allocating 50.3 GiB for the decode segment beside the pool;
docs/measurements.md). Here, before the pool is allocated, the prefill chunk and
the decode segment are compiled against an abstract pool (nothing allocated) and XLA's memory
analysis says what each needs beside its arguments: temporaries, generated code, and outputs
not written in place of a donated input. The pool then takes SAFETY of what is left after the
largest of those. The programs are compiled at the pool's provisional size (the largest it
could be): a program's needs do not grow as its pool shrinks, so the smaller pool chosen
still has room for them. One more compile of each program at start-up, on accelerators only
(the CPU reports no memory limit, and its pool is sized from the host's memory).
A device that cannot hold one slot's pages beside them is refused with the numbers
(sizing.fit_pages).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

import actionopd_jax.engine.programs as programs
from actionopd_jax.engine.groups import arrange
from actionopd_jax.engine.slots import host_slots


@dataclasses.dataclass
class ProgramNeeds:
    """XLA's memory analysis of one compiled program (bytes per device)."""

    kind: str
    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int

    @property
    def beside_arguments(self) -> int:
        """What running it takes beyond its arguments (the pool and weights among them)."""
        return self.temp + self.generated_code + max(0, self.output - self.alias)


def program_needs(kind: str, compiled) -> ProgramNeeds | None:
    """`compiled.memory_analysis()` as ProgramNeeds; None where the backend reports none."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - backends without a memory analysis
        return None
    if m is None:
        return None
    get = lambda name: int(getattr(m, f"{name}_size_in_bytes", 0) or 0)  # noqa: E731
    return ProgramNeeds(kind, get("argument"), get("output"), get("alias"), get("temp"), get("generated_code"))


def abstract_pool(engine, pages: int) -> programs.Pool:
    """The engine's pool of `pages` as abstract arrays, placed where empty_pool puts it (so a
    pool of the same size allocated later runs the program compiled against this one)."""
    shapes = jax.eval_shape(lambda: programs.empty_pool(engine.cfg, pages, engine.config.page_size, engine.dtype))
    sharding = programs.pool_sharding(engine.mesh, engine.cfg.num_key_value_heads) or \
        jax.sharding.SingleDeviceSharding(jax.local_devices()[0])     # no mesh: the default device
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes)


def engine_needs(engine, pages: int) -> list[ProgramNeeds]:
    """The prefill chunk's and the full-width decode segment's needs, compiled (with the
    engine's own compiler settings) against an abstract pool of `pages`; the weights are the
    engine's model's. Empty where the backend reports no memory analysis."""
    c = engine.config
    graphdef, params = nnx.split(engine.model)
    pool = abstract_pool(engine, pages)
    i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    chunk = engine.programs.compile(
        "chunk", programs.prefill_chunk,
        (graphdef, params, pool, i32(c.prefill_lanes, c.chunk), i32(c.prefill_lanes), i32(c.prefill_lanes),
         i32(c.prefill_lanes, c.pages_per_slot)),
        {"page_size": c.page_size, "attention": engine.attention()}, donate=(2,))
    host = host_slots(c.slots, c.pages_per_slot)
    slots = programs.Slots(fresh=np.zeros(c.slots, bool),
                           fresh_hidden=np.zeros((c.slots, engine.cfg.hidden_size), engine.dtype), **host)
    static = {"steps": c.max_segment, "page_size": c.page_size, "cap": engine.cap, "head": engine.lm_head,
              "backend": engine.backend, "attention": engine.attention()}
    # the full-width segment as the engine runs it: with its prompt sharing where it shares
    groups = arrange({}, host["table"], c, n_rows=c.slots)[1] if engine.shares_prompts() else None
    segment = engine.programs.compile(
        f"segment{c.slots}", programs.segment,
        (graphdef, params, engine._checked_head(), pool, slots, i32(c.slots), i32(c.slots), engine.eos_ids, groups,
         np.int32(c.segment), np.int32(0)), static, donate=(3,))
    found = [program_needs("prefill chunk", chunk), program_needs("decode segment", segment)]
    if engine.attention() in programs.FRESH_PREFILL:   # the chunk program for lanes that all start a prompt
        fresh = engine.programs.compile(
            "chunk_fresh", programs.prefill_chunk,
            (graphdef, params, pool, i32(c.prefill_lanes, c.chunk), i32(c.prefill_lanes), i32(c.prefill_lanes),
             i32(c.prefill_lanes, c.pages_per_slot)),
            {"page_size": c.page_size, "attention": engine.attention(), "fresh": True}, donate=(2,))
        found.append(program_needs("fresh-prompt prefill chunk", fresh))
    return [n for n in found if n is not None]


__all__ = ["ProgramNeeds", "abstract_pool", "engine_needs", "program_needs"]
