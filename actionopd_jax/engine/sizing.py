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
    between segments); run_ahead: a caller with every request already submitted
    (`Engine.step(run_ahead=True)`, the static sampler's API) lets a segment run up to
    segment * run_ahead steps while nothing waits to be admitted or prefilled (a freed slot
    has no taker then), ending early on CPU where the running rows fit a smaller row count;
    pages: pool size including the null page, or "auto" (`pool_pages`)."""

    slots: int = 32
    page_size: int = 16
    max_len: int = 4096
    chunk: int = 256
    prefill_lanes: int = 4
    segment: int = 16
    # each program call costs a fixed part (on CPU ~8 ms of set-up plus first touches of the
    # head's ~110 MB of temporaries, bench-tiny): fewer, longer calls where no scheduling is lost
    run_ahead: int = 8
    pages: int | str = "auto"
    # paged attention backend (model/attention/dispatch.PAGED_IMPLEMENTATIONS; "auto": the
    # platform's kernel, the gather path on CPU; "ragged_tpu" is refused by the engine)
    attention: str = "auto"
    # chunk calls one scheduler step may run before the next segment (prefill is interleaved
    # with decode so running rows are not stalled by a long prompt; a run_ahead step, where
    # nothing more is submitted, prefills every admitted prompt first: Engine.step)
    chunks_per_step: int = 4

    def __post_init__(self):
        for name in ("slots", "page_size", "max_len", "chunk", "prefill_lanes", "segment", "run_ahead",
                     "chunks_per_step"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"engine {name} must be >= 1, got {getattr(self, name)}")
        if not (self.pages == "auto" or (isinstance(self.pages, int) and self.pages >= 2)):
            raise ValueError(f"engine pages must be 'auto' or an int >= 2 (page 0 is the null page), got {self.pages!r}")
        from actionopd_jax.model.attention.dispatch import PAGED_IMPLEMENTATIONS

        if self.attention not in PAGED_IMPLEMENTATIONS:
            raise ValueError(f"engine attention={self.attention!r}; expected one of {PAGED_IMPLEMENTATIONS}")

    @property
    def max_segment(self) -> int:
        """Decode steps one segment program can run (its token buffers' width)."""
        return self.segment * self.run_ahead

    @property
    def pages_per_slot(self) -> int:
        return math.ceil(self.max_len / self.page_size)


def engine_attention(setting: str, platform: str, backend: str) -> str:
    """The engine's paged backend for `setting` on `platform` (dispatch.resolve_paged's
    names and refusals); the CPU backend's gather path reads live pages only ("live")."""
    from actionopd_jax.model.attention.dispatch import resolve_paged

    impl = resolve_paged(setting, platform)
    if impl == "ragged_tpu":
        raise ValueError("engine attention='ragged_tpu' is not supported: the engine keeps split k/v pools and "
                         "prefills chunks with explicit positions, which the ragged kernel does not take; use "
                         "'paged_tpu' (the default on TPU) or 'gather'")
    return "live" if impl == "gather" and backend == "cpu" else impl


def pages_for(cfg, engine: EngineConfig, free_bytes_per_chip: float, *, shards: int = 1, dtype: str = "float32",
              reserve_bytes: float = 0) -> int:
    """Pages (null page included) in what each chip can still allocate, less `reserve_bytes`
    per chip kept for state not allocated yet, times budget.SAFETY, the pool's KV heads split
    over `shards` chips."""
    per_page = budget_lib.cache_bytes_per_token(cfg, dtype) * engine.page_size / max(1, shards)
    pages = int(max(0.0, free_bytes_per_chip - reserve_bytes) * budget_lib.SAFETY // per_page)
    if pages < engine.pages_per_slot + 1:
        raise ValueError(f"the devices' free memory ({free_bytes_per_chip / 2**30:.2f} GiB per chip, "
                         f"{reserve_bytes / 2**30:.2f} GiB of it kept for the trainer) holds {pages} pages of "
                         f"{engine.page_size} tokens, fewer than one slot's {engine.pages_per_slot}: lower the "
                         "engine's max_len (collect.max_prompt_tokens + max_response_tokens; eval and serve: "
                         "--engine-max-len) or free memory")
    return pages + 1


def fit_pages(per_page: float, free_bytes: float, *, reserve_bytes: float, needs: list, min_pages: int,
              safety: float = budget_lib.SAFETY) -> int:
    """Pages (null page included) in `safety` of `free_bytes` less `reserve_bytes` less the
    largest of the programs' `needs` (pool_fit.ProgramNeeds: XLA's memory analysis); a
    ValueError with the numbers where that is under `min_pages` (one slot and the null page)."""
    gib = 2 ** 30
    beside = max((n.beside_arguments for n in needs), default=0)
    pages = int(max(0.0, free_bytes - reserve_bytes - beside) * safety // per_page)
    if pages + 1 < min_pages:
        worst = max(needs, key=lambda n: n.beside_arguments) if needs else None
        detail = (f"; the {worst.kind} program needs {beside / gib:.2f} GiB beside its arguments (XLA's memory "
                  f"analysis: temporaries {worst.temp / gib:.2f}, generated code {worst.generated_code / gib:.2f}, "
                  f"outputs not in place {max(0, worst.output - worst.alias) / gib:.2f})") if worst else ""
        raise ValueError(f"the engine's page pool does not fit: {free_bytes / gib:.2f} GiB free per chip, "
                         f"{reserve_bytes / gib:.2f} GiB of it kept for the trainer{detail}; {safety:.0%} of the rest "
                         f"holds {pages} pages of {per_page / 2 ** 20:.2f} MiB, fewer than one slot's {min_pages - 1}: "
                         "lower the engine's slots or max_len (collect.max_prompt_tokens + max_response_tokens; "
                         "eval and serve: --engine-max-len) or free memory")
    return pages + 1


def pool_shards(mesh, kv_heads: int) -> int:
    """Chips one copy of the pool is spread over: the "tensor" axis where it divides the KV
    heads (programs.pool_sharding), else 1 (each device holds it whole)."""
    from actionopd_jax.model.attention.paged_tpu import tensor_split

    axis = tensor_split(mesh, kv_heads)
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[axis] if axis else 1


# the share of the host's available memory a CPU engine's page pool may take (the process also
# holds the parameters, the programs' temporaries and the episodes)
HOST_POOL_FRACTION = 0.5


def host_available_bytes() -> float | None:
    """The host's available memory (Linux MemAvailable), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def pool_pages(cfg, engine: EngineConfig, *, mesh=None, dtype: str = "float32", reserve_bytes: float = 0,
               needs_at=None) -> int:
    """Pages in the pool (null page included). An int `engine.pages`: that. "auto":
    `pages_for` what the mesh's devices can still allocate now (budget.free_bytes_per_chip:
    the parameters and a resident trainer's state are in use) less `reserve_bytes` per chip
    (what the trainer allocates later while the pool stays resident: an update's gradients
    and activations). `needs_at(pages)`: the engine's programs compiled against a pool of that
    size, their XLA memory analyses (pool_fit.engine_needs); given, they are read at the
    provisional size and the pool `fit_pages` beside the largest. Where the platform reports no
    memory limit (CPU): every slot full plus as much again for the prefix cache."""
    if engine.pages != "auto":
        return int(engine.pages)
    free = budget_lib.free_bytes_per_chip(mesh)
    if free is None:
        wanted = 2 * engine.slots * engine.pages_per_slot + 1
        host = host_available_bytes()
        if host is None:
            return wanted
        # the model's own context (Qwen3: 40,960 tokens, issue 43 item 2) times every slot twice
        # is far more than host memory for any real model: at most HOST_POOL_FRACTION of what
        # the host has free now, and at least one slot (pages_for refuses less, saying so)
        return min(wanted, pages_for(cfg, engine, host * HOST_POOL_FRACTION, dtype=dtype))
    shards = pool_shards(mesh, cfg.num_key_value_heads) if mesh is not None else 1
    provisional = pages_for(cfg, engine, free, shards=shards, dtype=dtype, reserve_bytes=reserve_bytes)
    needs = needs_at(provisional) if needs_at is not None else []
    if not needs:   # the backend reports no memory analysis: SAFETY's margin is all the programs get
        return provisional
    per_page = budget_lib.cache_bytes_per_token(cfg, dtype) * engine.page_size / max(1, shards)
    return fit_pages(per_page, free, reserve_bytes=reserve_bytes, needs=needs, min_pages=engine.pages_per_slot + 1)


__all__ = ["EngineConfig", "engine_attention", "fit_pages", "host_available_bytes", "pages_for", "pool_pages",
           "pool_shards"]
