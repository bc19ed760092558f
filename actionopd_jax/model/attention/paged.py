"""The paged-attention switch: one call, one name per backend (dispatch.resolve_paged).

    paged_attention(q, k_pages, v_pages, lengths, page_table, q_positions=None, impl="auto", mesh=None)

takes the engine's pool and tables as `paged_gather.paged_attention_gather` does and runs:

- "gather" (paged_gather.py): gather each slot's pages, dense attention; the plain CPU path
  and the reference of the others;
- "paged_tpu" (paged_tpu.py): jax's Pallas TPU paged-attention kernel, same pool layout;
- "ragged_tpu" (paged_tpu.py): jax's Pallas TPU ragged paged attention; it stores k and v in
  one interleaved pool (`storage_layout("ragged_tpu") == "combined"`): pass that pool as
  k_pages and v_pages=None (split pools are combined here, a copy per call);
- "paged_gpu" (paged_gpu.py): jax's Pallas (Triton) GPU paged-attention kernel for decode,
  same layout; a chunk of several queries a slot goes to our kernel (paged_gpu_parts.py),
  which reads the pages once per block of queries, and so does decode where jax has no such
  kernel (0.12 removed it).

"auto" picks by the platform of the mesh being traced (dispatch.target_platform). On CPU the
Pallas backends run interpreted (tests); "ragged_tpu" is refused there.
"""

from __future__ import annotations

import jax.numpy as jnp

from actionopd_jax.model.attention.dispatch import abstract_mesh, resolve_paged, target_platform
from actionopd_jax.model.attention.paged_gather import default_positions, paged_attention_gather
from actionopd_jax.model.attention.paged_gpu import paged_attention_gpu
from actionopd_jax.model.attention.paged_gpu_parts import paged_parts_gpu
from actionopd_jax.model.attention.paged_live import merge_parts
from actionopd_jax.model.attention.paged_tpu import (STORAGE_LAYOUT, combine_pages, paged_attention_tpu,
                                                     ragged_paged_attention_tpu)
from actionopd_jax.jax_compat import has_pallas_kernel, shard_map


def storage_layout(impl: str, platform: str | None = None) -> str:
    """How backend `impl` wants the pool stored: "split" (k and v pools [KVH, pages, page, Dh],
    paged_gather.py's) or "combined" ([pages, page, 2 * KVH, Dh], k head h at 2h, v at 2h + 1)."""
    return STORAGE_LAYOUT.get(resolve_paged(impl, platform), "split")


def _per_head_shard(local, pages, *rest, rest_specs, mesh=None):
    """local(pages, *rest) run by each device on its own KV heads when the pool is split over
    a "tensor" axis (paged_tpu.tensor_split): row indices computed on the global pool would
    make the partitioner mask every row on every device and all-reduce what it gathers."""
    from jax.sharding import PartitionSpec as P

    from actionopd_jax.model.attention.paged_tpu import tensor_split
    import jax

    mesh = abstract_mesh(mesh)
    axis = tensor_split(mesh, pages.shape[0])
    if axis is None:
        return local(pages, *rest)
    return shard_map(local, mesh=mesh, in_specs=(P(axis), *(spec(axis) for spec in rest_specs)),
                     out_specs=P(axis))(pages, *rest)


def _write_rows_local(pages, page, offset, values):
    import jax.numpy as jnp

    kvh, n, size, dh = pages.shape
    rows = (page * size + offset).reshape(-1)
    at = (jnp.arange(kvh, dtype=rows.dtype)[:, None] * (n * size) + rows[None, :]).reshape(-1)
    vals = jnp.moveaxis(values.reshape(-1, kvh, dh), 1, 0).reshape(-1, dh).astype(pages.dtype)
    return pages.reshape(kvh * n * size, dh).at[at].set(vals).reshape(kvh, n, size, dh)


def write_rows(pages, page, offset, values, *, mesh=None):
    """pages [KVH, P, page_size, Dh] with values [*idx, KVH, Dh] stored at (page, offset) [*idx],
    as one scatter of token rows into the pool viewed as [KVH * P * page_size, Dh] (a reshape that
    keeps the tiled layout), per device over its own KV heads under a tensor-split mesh. The same
    result as `pages.at[:, page, offset].set(...)`; written that way, the TPU compiler gave the
    scatter another layout than the kernels' and copied the whole pool around it
    (docs/measurements_compiler.md, "Paged engine on TPU v5p-8")."""
    from jax.sharding import PartitionSpec as P

    lead = (None,) * (values.ndim - 2)
    return _per_head_shard(_write_rows_local, pages, page, offset, values, mesh=mesh,
                           rest_specs=(lambda a: P(), lambda a: P(), lambda a: P(*lead, a, None)))


def _copy_pages_local(pages, src, dst):
    import jax
    import jax.numpy as jnp

    kvh, n, size, dh = pages.shape
    within = jnp.arange(size, dtype=src.dtype)
    heads = jnp.arange(kvh, dtype=src.dtype)[:, None, None] * (n * size)
    src_rows = (heads + (src * size)[None, :, None] + within).reshape(-1)
    dst_rows = (heads + (dst * size)[None, :, None] + within).reshape(-1)
    flat = pages.reshape(kvh * n * size, dh)
    # the source rows read out first, as a buffer of their own: fused into the scatter, a read of
    # the pool it writes made XLA:GPU copy the whole pool around the scatter, twice a loop trip
    # (a pool-sized temporary, 20 GiB at 256 rows of the 4B on an H100, and 80 GiB of copies a
    # trip of 8 pages; aot/gpu_topology.py's compile showed it)
    rows = jax.lax.optimization_barrier(flat[src_rows])
    return flat.at[dst_rows].set(rows).reshape(kvh, n, size, dh)


def copy_pages(pages, src, dst, *, mesh=None):
    """pages [KVH, P, page_size, Dh] with page dst[m] made a copy of page src[m] (i32[M];
    pairs NULL -> NULL pad), in the same row view as `write_rows` and per device over its own KV
    heads, so the copy-on-write of a shared prompt's last page moves M pages, not the pool."""
    from jax.sharding import PartitionSpec as P

    return _per_head_shard(_copy_pages_local, pages, src, dst, mesh=mesh,
                           rest_specs=(lambda a: P(), lambda a: P()))


def paged_attention(q, k_pages, v_pages, lengths, page_table, *, q_positions=None, impl: str = "auto",
                    mesh=None):
    """Attention of q [slots, q_len, Hq, Dh] over each slot's pages (paged_gather.py for the
    shapes); returns [slots, q_len, Hq, Dh] in q's dtype."""
    mesh = abstract_mesh(mesh)
    platform = target_platform(mesh)
    impl = resolve_paged(impl, platform)
    interpret = platform == "cpu"
    if impl == "paged_tpu":
        return paged_attention_tpu(q, k_pages, v_pages, lengths, page_table, q_positions=q_positions, mesh=mesh,
                                   platform=platform, interpret=interpret)
    if impl == "ragged_tpu":
        pool = k_pages if v_pages is None else combine_pages(k_pages, v_pages)
        return ragged_paged_attention_tpu(q, pool, lengths, page_table, q_positions=q_positions, mesh=mesh,
                                          platform=platform)
    if impl == "paged_gpu" and (q.shape[1] > 1 or not has_pallas_kernel("gpu_paged_attention")):
        # a prefill chunk: our kernel with blocks of queries (paged_gpu_parts.py), not jax's
        # decode kernel with a row per token, each rereading the slot's pages; decode too where
        # this jax has no such kernel (0.12 removed it)
        if q_positions is None:
            q_positions = default_positions(lengths, q.shape[1])
        parts = paged_parts_gpu(q, k_pages, v_pages, jnp.maximum(lengths, 1), page_table, mesh=mesh,
                                q_positions=jnp.maximum(q_positions, 0), interpret=interpret)
        return merge_parts([parts], q.dtype)      # lengths and positions >= 0: key 0 keeps padding finite
    if impl == "paged_gpu":
        return paged_attention_gpu(q, k_pages, v_pages, lengths, page_table, q_positions=q_positions, mesh=mesh,
                                   interpret=interpret)
    if v_pages is None:
        raise ValueError("paged attention='gather' reads split k/v pools; got v_pages=None (a combined pool)")
    return paged_attention_gather(q, k_pages, v_pages, lengths, page_table, q_positions=q_positions)


__all__ = ["copy_pages", "paged_attention", "storage_layout", "write_rows"]
