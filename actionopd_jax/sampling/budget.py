"""Token budgets: how many states one device call of the sampler takes.

A call's memory (beyond the parameters) is its KV cache plus prefill's transient per-token
activations, so it is sized in *cache-token equivalents*:

    tokens(chunk) = PREFILL_FACTOR * prompt rows * padded prompt length
                    + prompt rows * samples * max_new         (generated-cache slots)

all counted after bucket padding (what the program really allocates). One cache token holds
k and v of every layer: 2 * L * KVH * Dh * bytes (Qwen3-4B bf16: 144 KiB, spread over the
chips that shard the KV heads and rows). The prefill factor is the prefill program's
per-prompt-token peak over a cached token: the stacked k/v the layer scan returns, their
transposed copy (the decode layout) when the compiler keeps one, the per-layer activations
of a token (hidden, MLP intermediate, q) and the first token's logits (measured with the AOT compiles in
benchmarks/sampler_aot.py for Qwen3-4B on v5p:2x2x1; see PREFILL_FACTOR). Decode after
prefill holds the prompt cache once plus the generated cache, so a chunk whose prefill fits
decodes in less.

The default budget (`default_token_budget`) is (bytes the device can still allocate) x
safety / bytes per cached token, per chip: the usable limit minus `memory_stats()
['bytes_in_use']` (the parameters, and whatever else lives there -- a colocated trainer's
optimizer state included) on an accelerator. The usable limit is the share of memory every
plan assumes (aot.targets.USABLE_MEMORY_FRACTION): on GPU the runtime's `bytes_limit` already is
that share (XLA_PYTHON_CLIENT_MEM_FRACTION, which every `actionopd` command sets from it),
elsewhere `bytes_limit` x the fraction -- so `train --check` plans the budget the sampler will take. CPUs report no limit:
no budget (unchanged chunking by the buckets' prompts/max_rows).
"""

from __future__ import annotations

import jax

# prefill peak per padded prompt token in cached tokens (k+v of all layers). Measured (AOT,
# Qwen3-4B bf16 on v5p:2x2x1, tensor=4, 16 x 24,576-token prompts, 4 x 4,096 new, through
# Qwen3.prefill_kv with splash): peak 26.35 GiB/chip = params 1.88 + generated cache 9.00 +
# 15.47 for 13.50 GiB of prompt cache, i.e. 1.15 (the layer scan writes the stacked k/v in
# place; temporaries 1.97 GiB are one layer's activations). 1.25 leaves a margin. Check of
# the plan (params + budget tokens x bytes) against compiled prefill peaks: 64 x 4,096:
# 49.12 vs 48.66 GiB; 32 x 24,576: 53.62 vs 50.82; 32 x 32,768: 64.87 vs 65.89 (SAFETY covers).
PREFILL_FACTOR = 1.25


def parse_token_budget(value) -> int | str | None:
    """The one reading of `collect.sampler_token_budget`: "auto" (from the accelerator's free
    memory at each call), "none" / "off" / "" / 0 (no budget: the buckets alone), or a positive
    number of tokens (an int or its digits). Anything else is a ValueError naming the setting."""
    if value is None or value == 0 or (isinstance(value, str) and value.strip().lower() in ("none", "off", "", "0")):
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    raise ValueError(f"collect.sampler_token_budget={value!r}; expected 'auto', 'none' or a positive "
                     "number of tokens")
SAFETY = 0.85  # fraction of the free memory a call may plan for (fragmentation, compiler slack)


def cache_bytes_per_token(cfg, dtype: str = "float32") -> int:
    """Bytes of k and v of one token over all layers, in the compute dtype `dtype`
    (`model.runtime.dtype`)."""
    import numpy as np

    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * np.dtype(dtype).itemsize


def chunk_tokens(prompt_rows: int, prompt_len: int, samples: int, max_new: int,
                 prefill_factor: float = PREFILL_FACTOR) -> float:
    """Cache-token equivalents of one padded call (see the module docstring)."""
    return prefill_factor * prompt_rows * prompt_len + prompt_rows * samples * max_new


def token_budget(cfg, free_bytes_per_chip: float, chips: int, *, safety: float = SAFETY,
                 dtype: str = "float32") -> int:
    """Cache-token equivalents that fit `free_bytes_per_chip` on each of `chips` chips (the
    cache is spread over them: KV heads over tensor, prompt rows over data/fsdp)."""
    return max(1, int(free_bytes_per_chip * safety * chips // cache_bytes_per_token(cfg, dtype)))


def usable_limit(bytes_limit: float, platform: str) -> float:
    """The bytes a run may plan for on a device reporting `bytes_limit` (module docstring)."""
    from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION

    return bytes_limit if platform == "gpu" else bytes_limit * USABLE_MEMORY_FRACTION


def free_bytes_per_chip(mesh=None) -> float | None:
    """What each of this process's devices of `mesh` (or the default device) can still
    allocate, the least of them: the usable limit less `bytes_in_use`; None where the platform
    reports no memory limit (CPU)."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
    free = None
    for d in devices:
        if not getattr(d, "is_addressable", True) or d.process_index != jax.process_index():
            continue
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - backends without memory stats
            stats = None
        if not stats or "bytes_limit" not in stats:
            return None
        left = usable_limit(stats["bytes_limit"], d.platform) - stats.get("bytes_in_use", 0)
        free = left if free is None else min(free, left)
    return free


def default_token_budget(cfg, mesh=None, *, safety: float = SAFETY, dtype: str = "float32",
                         reserve_bytes: float = 0.0) -> int | None:
    """The budget from what the mesh's devices (or the default device) can still allocate,
    less `reserve_bytes` a chip kept for something else (a training update running beside the
    calls); None where the platform reports no memory limit (CPU)."""
    free = free_bytes_per_chip(mesh)
    if free is None:
        return None
    devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
    return token_budget(cfg, max(0.0, free - reserve_bytes), len(devices), safety=safety, dtype=dtype)


def plan_chunks(ns, prompt_lens, max_news, buckets, token_budget: int | None = None,
                prefill_factor: float = PREFILL_FACTOR) -> list[list[int]]:
    """Consecutive prompt groups (indices) whose padded size stays within the largest prompts
    bucket, `buckets.max_rows` and, when given, `token_budget` (chunk_tokens after bucket
    padding). A single prompt over the budget still gets a chunk of its own."""
    from actionopd_jax.sampling.buckets import Buckets

    b = buckets

    def padded(group: list[int]) -> tuple[int, int, int, int]:
        return (Buckets.fit(len(group), b.prompts, "prompts"),
                Buckets.fit(max(int(ns[j]) for j in group), b.samples, "samples"),
                Buckets.fit(max(int(prompt_lens[j]) for j in group), b.prompt_len, "prompt_len"),
                Buckets.fit(max(int(max_news[j]) for j in group), b.max_new, "max_new"))

    def fits(group: list[int]) -> bool:
        if len(group) > b.prompts[-1]:
            return False
        rows, samples, plen, new = padded(group)
        if rows * samples > b.max_rows:
            return False
        return token_budget is None or chunk_tokens(rows, plen, samples, new, prefill_factor) <= token_budget

    chunks: list[list[int]] = []
    current: list[int] = []
    for i in range(len(ns)):
        if current and not fits(current + [i]):
            chunks.append(current)
            current = []
        current.append(i)
    chunks.append(current)
    return chunks


def describe(cfg, budget: int | None, dtype: str = "float32") -> str:
    if budget is None:
        return "no token budget"
    gib = budget * cache_bytes_per_token(cfg, dtype) / 2 ** 30
    return f"token budget {budget} cache tokens ({gib:.1f} GiB of KV over the mesh)"


__all__ = ["PREFILL_FACTOR", "SAFETY", "cache_bytes_per_token", "chunk_tokens", "default_token_budget",
           "plan_chunks", "token_budget", "usable_limit"]
