"""The engine's fixed shapes, and the page pool sized from what the devices can still hold."""

from __future__ import annotations

import dataclasses
import math

import actionopd_jax.sampling.budget as budget_lib


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Compile-time shapes of the engine (a different request mix never changes them).

    slots: decode rows run together by one segment; page_size: tokens per page; max_len: tokens
    one slot can hold (prompt + generated), so pages_per_slot = ceil(max_len / page_size);
    chunk: prompt tokens per prefill lane per chunk call; prefill_lanes: prompts one chunk call
    takes; segment: decode steps per segment (the scheduler's granularity: rows leave and join
    between segments); pages: pool size including the null page, or "auto" (`pool_pages`)."""

    slots: int = 32
    page_size: int = 16
    max_len: int = 4096
    chunk: int = 256
    prefill_lanes: int = 4
    segment: int = 16
    pages: int | str = "auto"
    # paged attention backend (model/attention/dispatch.PAGED_IMPLEMENTATIONS; "auto": the
    # platform's kernel, the gather path on CPU; "ragged_tpu" is refused by the engine)
    attention: str = "auto"
    # chunk calls one scheduler step may run before the next segment (prefill is interleaved
    # with decode so running rows are not stalled by a long prompt)
    chunks_per_step: int = 4

    def __post_init__(self):
        for name in ("slots", "page_size", "max_len", "chunk", "prefill_lanes", "segment", "chunks_per_step"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"engine {name} must be >= 1, got {getattr(self, name)}")
        if not (self.pages == "auto" or (isinstance(self.pages, int) and self.pages >= 2)):
            raise ValueError(f"engine pages must be 'auto' or an int >= 2 (page 0 is the null page), got {self.pages!r}")
        from actionopd_jax.model.attention.dispatch import PAGED_IMPLEMENTATIONS

        if self.attention not in PAGED_IMPLEMENTATIONS:
            raise ValueError(f"engine attention={self.attention!r}; expected one of {PAGED_IMPLEMENTATIONS}")

    @property
    def pages_per_slot(self) -> int:
        return math.ceil(self.max_len / self.page_size)


def pool_pages(cfg, engine: EngineConfig, *, mesh=None, dtype: str = "float32", reserve_bytes: int = 0) -> int:
    """Pages in the pool (null page included). An int `engine.pages`: that. "auto": the
    sampler's token budget (budget.default_token_budget: the devices' usable memory minus what
    is in use now -- the parameters and a resident trainer's state -- times budget.SAFETY),
    less `reserve_bytes` per chip for state not allocated yet, in pages. Where the platform
    reports no memory limit (CPU): every slot full plus as much again for the prefix cache."""
    if engine.pages != "auto":
        return int(engine.pages)
    full = engine.slots * engine.pages_per_slot
    tokens = budget_lib.default_token_budget(cfg, mesh, dtype=dtype)
    if tokens is None:
        return 2 * full + 1
    tokens -= int(reserve_bytes * budget_lib.SAFETY // budget_lib.cache_bytes_per_token(cfg, dtype))
    pages = tokens // engine.page_size
    if pages < engine.pages_per_slot + 1:
        raise ValueError(f"the devices' free memory holds {max(pages, 0)} pages of {engine.page_size} tokens, "
                         f"fewer than one slot's {engine.pages_per_slot}: lower engine max_len or free memory")
    return int(pages) + 1


__all__ = ["EngineConfig", "pool_pages"]
