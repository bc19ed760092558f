"""Decode attention on NVIDIA GPUs that returns the online softmax's parts, so a prompt's
pages are read once for all of its samples: our own Pallas (Triton) kernel.

The engine's GPU decode ran jax's `ops.gpu.paged_attention` (paged_gpu.py) with one row per
slot, so 4 samples of a 4,096-token prompt read its pages 4 times a step. At the device check's
256-row workload (64 prompts x 4 samples, 1,024-4,096 tokens) that is about 3x the bytes of the
HBM bound, which reads a shared prompt once: no kernel speed could reach half the bound. jax's
kernel returns the normalised output only, so its passes cannot be merged with another pass
over other keys; this one returns what `paged_live.live_part` returns, (top, total, acc),
float32, and `paged_live.merge_parts` merges the engine's two passes (engine/programs.py,
`_shared_attend`): the block's prompt pages once for its samples' queries, then each row's own
pages.

    paged_parts_gpu(q, k_pages, v_pages, lengths, page_table) -> (top, total, acc)

q [S, T, Hq, Dh]: T queries per row, every one seeing the row's first `lengths[s]` keys (the
shared pass: a block's samples as its T; decode: T = 1). Pages [KVH, P, page_size, Dh] as the
pool stores them; page_table i32[S, pages_per_slot]. Returns [S, KVH, G, T] (top, total) and
[S, KVH, G, T, Dh] (acc) with G = Hq / KVH, live_part's layout.

One program per (row, KV head, partition of the table): its queries, T x G of them padded to a
power of two >= 16 (Triton's smallest dot), are one block, so each key block is loaded once
for all of them; with Qwen3-4B's 4 query heads per KV head and 4 samples that is exactly 16.
A partition stops after its last live page. The partitions' parts are merged here in jax.
Scores and softmax in float32; in float32 the dots are exact (no TF32), for the device's token
parity stage. `interpret=True` runs it in Pallas interpret mode (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from actionopd_jax.model.attention.paged_gpu import gpu_blocks
from actionopd_jax.model.attention.paged_live import MASK_VALUE
from actionopd_jax.model.attention.paged_tpu import tensor_split
from actionopd_jax.jax_compat import shard_map

MIN_QUERIES = 16        # Triton's smallest dot: the query block is padded to it
NUM_WARPS, NUM_STAGES = 4, 2


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def _kernel(q_ref, k_ref, v_ref, table_ref, length_ref, top_ref, total_ref, acc_ref, *, block_pages, exact):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    part = pl.program_id(2)
    pages_per_part = table_ref.shape[0]
    page_size, dh = k_ref.shape[-2], k_ref.shape[-1]
    width = block_pages * page_size
    length = length_ref[0]
    first = part * pages_per_part
    live = jnp.clip(pl.cdiv(length, page_size) - first, 0, pages_per_part)    # this partition's live pages
    q = q_ref[...]
    m = q.shape[0]
    dot = functools.partial(plgpu.dot, allow_tf32=False) if exact else plgpu.dot

    def block(b, carry):
        top, total, acc = carry
        ids = table_ref[pl.ds(b * block_pages, block_pages)]
        k = k_ref[ids].reshape(width, dh)
        v = v_ref[ids].reshape(width, dh)
        scores = dot(q, k.T)                                                   # [M, width] float32
        key_pos = (first + b * block_pages) * page_size + jnp.arange(width)
        scores = jnp.where((key_pos < length)[None, :], scores, MASK_VALUE)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        fix = jnp.exp(top - new_top)
        e = jnp.exp(scores - new_top[:, None])
        total = total * fix + e.sum(axis=-1)
        acc = acc * fix[:, None] + dot(e.astype(v.dtype), v)
        return new_top, total, acc

    init = (jnp.full((m,), MASK_VALUE, jnp.float32), jnp.zeros((m,), jnp.float32),
            jnp.zeros((m, dh), jnp.float32))
    top, total, acc = jax.lax.fori_loop(0, pl.cdiv(live, block_pages), block, init)
    top_ref[...] = top
    total_ref[...] = total
    acc_ref[...] = acc


def _merge_partitions(top, total, acc):
    """[splits, ...] parts over disjoint keys -> one part (the log-sum-exp merge)."""
    best = top.max(axis=0)
    fix = jnp.exp(top - best[None])
    return best, (total * fix).sum(axis=0), (acc * fix[..., None]).sum(axis=0)


def _local(q, k_pages, v_pages, lengths, page_table, *, interpret):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    rows, t, hq, dh = q.shape
    kvh, n_pages, page_size, _ = k_pages.shape
    g = hq // kvh
    m = _pow2_at_least(t * g, MIN_QUERIES)
    splits, block_pages = gpu_blocks(page_table.shape[1], page_size)
    per_part = page_table.shape[1] // splits
    # [S, T, KVH, G, Dh] -> [S, KVH, T * G, Dh]: query (t, g) of KV head h is row t * G + g of its block
    qb = (q.astype(jnp.float32) * dh ** -0.5).reshape(rows, t, kvh, g, dh).transpose(0, 2, 1, 3, 4)
    qb = jnp.pad(qb.reshape(rows, kvh, t * g, dh), ((0, 0), (0, 0), (0, m - t * g), (0, 0))).astype(k_pages.dtype)
    kernel = functools.partial(_kernel, block_pages=block_pages, exact=k_pages.dtype == jnp.float32)
    pages_spec = pl.BlockSpec((None, n_pages, page_size, dh), lambda s, h, p: (h, 0, 0, 0))
    top, total, acc = pl.pallas_call(
        kernel,
        grid=(rows, kvh, splits),
        in_specs=[pl.BlockSpec((None, None, m, dh), lambda s, h, p: (s, h, 0, 0)),
                  pages_spec, pages_spec,
                  pl.BlockSpec((None, None, per_part), lambda s, h, p: (s, p, 0)),
                  pl.BlockSpec((1,), lambda s, h, p: (s,))],
        out_specs=[pl.BlockSpec((None, None, None, m), lambda s, h, p: (p, s, h, 0)),
                   pl.BlockSpec((None, None, None, m), lambda s, h, p: (p, s, h, 0)),
                   pl.BlockSpec((None, None, None, m, dh), lambda s, h, p: (p, s, h, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((splits, rows, kvh, m), jnp.float32),
                   jax.ShapeDtypeStruct((splits, rows, kvh, m), jnp.float32),
                   jax.ShapeDtypeStruct((splits, rows, kvh, m, dh), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name=f"paged_parts_m{m}_pages{block_pages}",
    )(qb, k_pages, v_pages, page_table.reshape(rows, splits, per_part), lengths.astype(jnp.int32))
    top, total, acc = _merge_partitions(top, total, acc)
    # [S, KVH, M(, Dh)] -> live_part's [S, KVH, G, T(, Dh)]
    top, total = (x[..., :t * g].reshape(rows, kvh, t, g).swapaxes(2, 3) for x in (top, total))
    acc = acc[..., :t * g, :].reshape(rows, kvh, t, g, dh).swapaxes(2, 3)
    return top, total, acc


def paged_parts_gpu(q, k_pages, v_pages, lengths, page_table, *, mesh=None, interpret: bool = False):
    """The kernel's parts (module docstring). Under a mesh with a "tensor" axis dividing KVH
    each GPU runs its own KV heads; shapes are checked as the "paged_gpu" backend checks them."""
    from actionopd_jax.model.attention.paged_gpu import check_gpu_shapes

    check_gpu_shapes((q.shape[0], 1, q.shape[2], q.shape[3]), k_pages.shape, page_table.shape)
    local = functools.partial(_local, interpret=interpret)
    axis = tensor_split(mesh, k_pages.shape[0])
    if axis is None:
        return local(q, k_pages, v_pages, lengths, page_table)
    heads, parts = P(None, None, axis), P(None, axis)
    return shard_map(local, mesh=mesh, in_specs=(heads, P(axis), P(axis), P(), P()),
                     out_specs=(parts, parts, parts))(q, k_pages, v_pages, lengths, page_table)


__all__ = ["MIN_QUERIES", "paged_parts_gpu"]
