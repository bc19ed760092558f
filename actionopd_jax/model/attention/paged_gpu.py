"""Paged attention on NVIDIA GPUs: jax's Pallas (Triton) `ops.gpu.paged_attention`.

The "paged_gpu" backend of the paged switch (paged.py). The kernel reads the engine's pool in
its own layout (paged_gather.py), k/v pages [KVH, total_pages, page_size, Dh], so nothing is
copied. It is a decode kernel (one query per row): called with a chunk of q_len queries it
runs q_len rows over the same page table, row (slot, i) seeing min(lengths, q_positions + 1)
keys (paged_tpu.query_rows), each rereading the pages; the switch (paged.py) sends chunks to
our kernel instead (paged_gpu_parts.py, a read per block of queries). The kernel splits each
row's pages into `k_splits` partitions that run in parallel and merges them
(flash-decoding), and pads the query heads of one KV head to a block of 16 (Triton's smallest
dot); its softmax has no scale, so q is scaled here.

Limits (refused by name): head_dim a power of two >= 16 and page_size * pages per block >= 16
(Triton dot sizes). jax's `ops.gpu.decode_attention` is not used: it takes a contiguous
[rows, seq, KVH, Dh] cache, so it would need the pages gathered first, the very read this
kernel saves. `interpret=True` runs it in Pallas interpret mode (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from actionopd_jax.model.attention.paged_tpu import query_rows, tensor_split
from actionopd_jax.jax_compat import pallas_kernel, shard_map

BLOCK_H = 16           # query heads per program (the kernel's minimum and default)
_MAX_SPLITS = 16       # the kernel's default k_splits
_MAX_PAGES_PER_BLOCK = 8
BLOCK_KEYS = 128       # keys per kernel block worth more than partitions (jax's default block: 8 x 16)


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def gpu_blocks(pages_per_slot: int, page_size: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) for a page table of pages_per_slot columns: keys per
    block as many as a partition allows up to BLOCK_KEYS (pages: a power of two <= 8 dividing
    it), then the most partitions (<= 16) that divide the table. Most partitions first gave the
    H200's 4B run (272 pages of 16 = 16 x 17) one-page blocks, a 16 x 16 dot per step of the
    kernel's loop, at 0.57x the static sampler's decode (docs/measurements.md); now 2 partitions
    of 8-page blocks (not yet measured on a GPU)."""
    options = []
    for splits in range(1, min(pages_per_slot, _MAX_SPLITS) + 1):
        if pages_per_slot % splits == 0:
            part = pages_per_slot // splits          # Triton's in-kernel arrays: powers of two only
            block = max(b for b in (1, 2, 4, 8) if b <= _MAX_PAGES_PER_BLOCK and part % b == 0)
            options.append((min(block * page_size, BLOCK_KEYS), splits, block))
    _, splits, block = max(options)
    return splits, block


def check_gpu_shapes(q_shape, pages_shape, page_table_shape) -> tuple[int, int]:
    """Refuse what the GPU kernel cannot take, naming the limit; returns gpu_blocks(...)."""
    _, _, hq, dh = q_shape
    kvh, _, page_size, dh_k = pages_shape
    if dh_k != dh or hq % kvh:
        raise ValueError(f"attention='paged_gpu': q {tuple(q_shape)} does not group over pages {tuple(pages_shape)} "
                         "([KVH, total_pages, page_size, Dh], Hq a multiple of KVH)")
    if dh < 16 or dh & (dh - 1):
        raise ValueError(f"attention='paged_gpu': head_dim {dh} is not a power of two >= 16 (Triton's dot); "
                         "use the 'gather' path")
    splits, block = gpu_blocks(page_table_shape[1], page_size)
    if block * page_size < 16:
        raise ValueError(f"attention='paged_gpu': {page_table_shape[1]} pages per slot of {page_size} tokens give "
                         f"blocks of {block * page_size} keys, under Triton's 16; use larger pages")
    return splits, block


def _local(q, k_pages, v_pages, lengths, page_table, q_positions, *, splits, block, interpret):
    paged_attention = pallas_kernel("gpu_paged_attention")  # where this jax keeps it (jax_compat)

    slots, q_len, hq, dh = q.shape
    rows, seen, table = query_rows(q * dh ** -0.5, lengths, page_table, q_positions)
    out = paged_attention(rows.astype(k_pages.dtype), k_pages, v_pages, table, seen, block_h=BLOCK_H,
                          pages_per_compute_block=block, k_splits=splits, interpret=interpret)
    return out.reshape(slots, q_len, hq, dh).astype(q.dtype)


def paged_attention_gpu(q, k_pages, v_pages, lengths, page_table, *, q_positions=None, mesh=None,
                        interpret: bool = False):
    """The "paged_gpu" backend (module docstring); same arguments as `paged_attention_gather`.
    Under a mesh with a "tensor" axis dividing KVH each GPU runs its own KV heads."""
    splits, block = check_gpu_shapes(q.shape, k_pages.shape, page_table.shape)
    if q_positions is None:
        q_positions = lengths[:, None] - q.shape[1] + jnp.arange(q.shape[1], dtype=lengths.dtype)[None, :]
    local = functools.partial(_local, splits=splits, block=block, interpret=interpret)
    axis = tensor_split(mesh, k_pages.shape[0])
    if axis is None:
        return local(q, k_pages, v_pages, lengths, page_table, q_positions)
    heads = P(None, None, axis)
    return shard_map(local, mesh=mesh, in_specs=(heads, P(axis), P(axis), P(), P(), P()),
                     out_specs=heads)(q, k_pages, v_pages, lengths, page_table, q_positions)


__all__ = ["BLOCK_H", "check_gpu_shapes", "gpu_blocks", "paged_attention_gpu"]
