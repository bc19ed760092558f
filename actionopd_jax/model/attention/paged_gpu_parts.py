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

q [S, T, Hq, Dh]: T queries per row, each seeing the row's first `lengths[s]` keys up to its
position (q_positions; default: all of them: the shared pass, a block's samples as its T, and
decode, T = 1). Pages [KVH, P, page_size, Dh] as the pool stores them; page_table
i32[S, pages_per_slot]. Returns [S, KVH, G, T] (top, total) and [S, KVH, G, T, Dh] (acc) with
G = Hq / KVH, live_part's layout.

One program per (row, KV head, block of queries, partition of the table): the row's T x G
queries of the KV head go in blocks of up to QUERY_BLOCK, padded to a power of two >= 16
(Triton's smallest dot), so each key block is loaded once for all queries of a block; with
Qwen3-4B's 4 query heads per KV head and 4 samples the shared pass is exactly one block of 16.
A program stops after the last live page its queries see, and loads only the keys below its
row's length: the tail of a compute block (a reply's pages are held from admission) costs no
HBM read, and a freed page's NaN there cannot reach acc. It stores only its real queries (a
decode row's 4 of its 16), and only those are merged. The partitions' parts are merged
here in jax. The same kernel runs the prefill chunks that continue a prompt (paged_gpu.py): a
chunk of 512 tokens reads the history 32 times (blocks of 16 tokens x 4 heads) instead of 512
times (one decode row per token, jax's kernel).
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

MIN_QUERIES = 16        # Triton's smallest dot: a query block is padded to it
QUERY_BLOCK = 64        # queries per program when a row has more (a prefill chunk: 16 tokens x 4 heads)
# 8 warps for both blocks, 2 stages. Compiled for sm_90a by Triton 3.6 at Qwen3-4B's shapes
# (benchmarks/kernel_resources.py; compiler facts, not timings): with 4 warps the 16-query block
# took 232 registers a thread, so an SM held 8 of the decode's warps, with 8 warps 124 and 16; the
# 64-query block took 254 (4 warps: 4 warps an SM at 2 stages) and 171 (8). No spills in any.
NUM_WARPS = 8
NUM_STAGES = 2


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def _kernel(q_ref, pos_ref, k_ref, v_ref, table_ref, length_ref, top_ref, total_ref, acc_ref, *, block_pages,
            n_real, exact):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    part = pl.program_id(3)
    pages_per_part = table_ref.shape[0]
    page_size, dh = k_ref.shape[-2], k_ref.shape[-1]
    width = block_pages * page_size
    q, pos = q_ref[...], pos_ref[...]
    length = jnp.minimum(length_ref[0], pos.max() + 1)      # no query of the block sees further
    first = part * pages_per_part
    live = jnp.clip(pl.cdiv(length, page_size) - first, 0, pages_per_part)    # this partition's live pages
    dot = functools.partial(plgpu.dot, allow_tf32=False) if exact else plgpu.dot

    def block(b, carry):
        top, total, acc = carry
        ids = table_ref[pl.ds(b * block_pages, block_pages)]
        key_pos = (first + b * block_pages) * page_size + jnp.arange(width)
        # Only the keys below `length` are loaded (the rest read as 0): the block's pages past
        # the row's last live one (a reply's pages are allocated ahead) and the last page's
        # unwritten tail cost no HBM reads, and whatever they hold (a freed page's NaN) never
        # reaches acc, where 0 x NaN would.
        seen = jnp.broadcast_to((key_pos < length).reshape(block_pages, page_size, 1), (block_pages, page_size, dh))
        where = (ids[:, None, None], jnp.arange(page_size)[None, :, None], jnp.arange(dh)[None, None, :])
        k = plgpu.load(k_ref.at[where], mask=seen, other=0.0).reshape(width, dh)
        v = plgpu.load(v_ref.at[where], mask=seen, other=0.0).reshape(width, dh)
        scores = dot(q, k.T)                                                   # [M, width] float32
        scores = jnp.where((key_pos[None, :] < length) & (key_pos[None, :] <= pos[:, None]), scores, MASK_VALUE)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        fix = jnp.exp(top - new_top)
        e = jnp.exp(scores - new_top[:, None])
        total = total * fix + e.sum(axis=-1)
        acc = acc * fix[:, None] + dot(e.astype(v.dtype), v)
        return new_top, total, acc

    m = q.shape[0]
    init = (jnp.full((m,), MASK_VALUE, jnp.float32), jnp.zeros((m,), jnp.float32),
            jnp.zeros((m, dh), jnp.float32))
    top, total, acc = jax.lax.fori_loop(0, pl.cdiv(live, block_pages), block, init)
    # only the block's real queries are stored: a decode row's 4 heads of its 16 (the padding
    # rows stay unwritten, and the merge reads only the real ones)
    real = pl.program_id(2) * m + jnp.arange(m) < n_real
    plgpu.store(top_ref, top, mask=real)
    plgpu.store(total_ref, total, mask=real)
    plgpu.store(acc_ref, acc, mask=jnp.broadcast_to(real[:, None], (m, dh)))


def _merge_partitions(top, total, acc):
    """[splits, ...] parts over disjoint keys -> one part (the log-sum-exp merge). A query that
    saw no key of a partition has that partition's top at MASK_VALUE, so it weighs 0 beside
    one that saw a key (partition 0 holds key 0, which every query sees)."""
    best = top.max(axis=0)
    fix = jnp.exp(top - best[None])
    return best, (total * fix).sum(axis=0), (acc * fix[..., None]).sum(axis=0)


def kernel_parts(q, k_pages, v_pages, lengths, page_table, q_positions, *, interpret):
    """The kernel's own outputs, before any merge: (top, total) [splits, S, KVH, Q] and acc
    [splits, S, KVH, Q, Dh], Q the queries padded to whole blocks (rows past T * G never
    written), float32."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    rows, t, hq, dh = q.shape
    kvh, n_pages, page_size, _ = k_pages.shape
    g = hq // kvh
    n = t * g
    m = _pow2_at_least(min(n, QUERY_BLOCK), MIN_QUERIES)
    q_blocks = -(-n // m)
    splits, block_pages = gpu_blocks(page_table.shape[1], page_size)
    per_part = page_table.shape[1] // splits
    # [S, T, KVH, G, Dh] -> [S, KVH, T * G, Dh]: query (t, g) of KV head h is row t * G + g of its blocks
    qb = (q.astype(jnp.float32) * dh ** -0.5).reshape(rows, t, kvh, g, dh).transpose(0, 2, 1, 3, 4)
    qb = jnp.pad(qb.reshape(rows, kvh, n, dh), ((0, 0), (0, 0), (0, q_blocks * m - n), (0, 0))).astype(k_pages.dtype)
    pos = jnp.pad(jnp.repeat(q_positions.astype(jnp.int32), g, axis=1), ((0, 0), (0, q_blocks * m - n)),
                  constant_values=-1)                                          # padding queries see nothing
    kernel = functools.partial(_kernel, block_pages=block_pages, n_real=n, exact=k_pages.dtype == jnp.float32)
    pages_spec = pl.BlockSpec((None, n_pages, page_size, dh), lambda s, h, b, p: (h, 0, 0, 0))
    part_spec = pl.BlockSpec((None, None, None, m), lambda s, h, b, p: (p, s, h, b))
    part_shape = jax.ShapeDtypeStruct((splits, rows, kvh, q_blocks * m), jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(rows, kvh, q_blocks, splits),
        in_specs=[pl.BlockSpec((None, None, m, dh), lambda s, h, b, p: (s, h, b, 0)),
                  pl.BlockSpec((None, m), lambda s, h, b, p: (s, b)),
                  pages_spec, pages_spec,
                  pl.BlockSpec((None, None, per_part), lambda s, h, b, p: (s, p, 0)),
                  pl.BlockSpec((1,), lambda s, h, b, p: (s,))],
        out_specs=[part_spec, part_spec,
                   pl.BlockSpec((None, None, None, m, dh), lambda s, h, b, p: (p, s, h, b, 0))],
        out_shape=[part_shape, part_shape,
                   jax.ShapeDtypeStruct((splits, rows, kvh, q_blocks * m, dh), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name=f"paged_parts_m{m}_pages{block_pages}",
    )(qb, pos, k_pages, v_pages, page_table.reshape(rows, splits, per_part), lengths.astype(jnp.int32))


def _local(q, k_pages, v_pages, lengths, page_table, q_positions, *, interpret):
    rows, t, hq, dh = q.shape
    kvh = k_pages.shape[0]
    g = hq // kvh
    n = t * g
    top, total, acc = kernel_parts(q, k_pages, v_pages, lengths, page_table, q_positions, interpret=interpret)
    # the real queries only (the padding rows were never written), then the partitions merged
    top, total, acc = _merge_partitions(top[..., :n], total[..., :n], acc[..., :n, :])
    # [S, KVH, T * G(, Dh)] -> live_part's [S, KVH, G, T(, Dh)]
    top, total = (x.reshape(rows, kvh, t, g).swapaxes(2, 3) for x in (top, total))
    acc = acc.reshape(rows, kvh, t, g, dh).swapaxes(2, 3)
    return top, total, acc


def paged_parts_gpu(q, k_pages, v_pages, lengths, page_table, *, q_positions=None, mesh=None,
                    interpret: bool = False):
    """The kernel's parts (module docstring). q_positions i32[S, T]: query t sees keys up to
    its position (causal) as well as below `lengths`; None: every query sees all `lengths`
    keys. Under a mesh with a "tensor" axis dividing KVH each GPU runs its own KV heads; shapes
    are checked as the "paged_gpu" backend checks them."""
    from actionopd_jax.model.attention.paged_gpu import check_gpu_shapes

    check_gpu_shapes((q.shape[0], 1, q.shape[2], q.shape[3]), k_pages.shape, page_table.shape)
    if q_positions is None:
        q_positions = jnp.broadcast_to(lengths[:, None] - 1, q.shape[:2])
    local = functools.partial(_local, interpret=interpret)
    axis = tensor_split(mesh, k_pages.shape[0])
    if axis is None:
        return local(q, k_pages, v_pages, lengths, page_table, q_positions)
    heads, parts = P(None, None, axis), P(None, axis)
    return shard_map(local, mesh=mesh, in_specs=(heads, P(axis), P(axis), P(), P(), P()),
                     out_specs=(parts, parts, parts))(q, k_pages, v_pages, lengths, page_table, q_positions)


__all__ = ["MIN_QUERIES", "NUM_STAGES", "NUM_WARPS", "QUERY_BLOCK", "paged_parts_gpu"]
