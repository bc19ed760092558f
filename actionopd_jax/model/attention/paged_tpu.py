"""Paged attention on TPU: jax's Pallas kernels over the engine's page pool.

Two backends, one name each in the paged switch (paged.py):

- "paged_tpu": `jax.experimental.pallas.ops.tpu.paged_attention`, which reads the pool in the
  engine's own layout (paged_gather.py): k/v pages [KVH, total_pages, page_size, Dh]. It is a
  decode kernel (one query per row); a chunk of q_len queries runs as q_len rows over the same
  page table, row (slot, i) seeing min(lengths, q_positions + 1) keys. That reads a slot's
  pages once per query, fine for decode and short chunks, not for long prefills (which the
  engine runs through the model's fused causal attention).
- "ragged_tpu": `...ops.tpu.ragged_paged_attention` (mixed prefill and decode rows in one
  call). It stores k and v interleaved in one pool, [total_pages, page_size, 2 * KVH, Dh]
  (k head h at 2h, v at 2h + 1): `STORAGE_LAYOUT["ragged_tpu"]` says so, `combine_pages`
  builds that pool from the engine's. Its queries are the last q_len tokens of each slot
  (q_positions must be the default, `paged_gather.default_positions`).

Both take q [slots, q_len, Hq, Dh] and return it in q's dtype, scaled by Dh ** -0.5 inside,
query head h reading KV head h // (Hq // KVH) (the model's grouping). Block sizes are passed
explicitly: the kernels' tuned tables read `jax.devices()[0]`, which is the host's CPU when a
CPU host compiles for a TPU topology. Under a mesh with a "tensor" axis dividing KVH, the
kernel runs per device on its KV heads (shard_map); other axes see the whole pool.
Neither kernel has an interpret switch: `interpret=True` runs them under Pallas' TPU
interpret mode (`force_tpu_interpret_mode`, CPU tests). That mode computes matmuls at the
TPU's default (bfloat16-operand) precision, and the ragged kernel does not run in it in jax
0.10.2 (its strided k/v loads hit an interpreter gap); it is proven by compiling for v5p.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from actionopd_jax.jax_compat import shard_map

# how each backend wants the pool stored (the engine asks before allocating pages)
STORAGE_LAYOUT = {"paged_tpu": "split", "ragged_tpu": "combined"}
LANES = 128            # Mosaic's lane width: head_dim must be a multiple of it on TPU
_MAX_PAGES_PER_BLOCK = 16


def pages_per_block(pages_per_slot: int, page_size: int, limit: int = _MAX_PAGES_PER_BLOCK) -> int:
    """Pages the kernel reads per inner block: the largest divisor of pages_per_slot with at
    most ~512 tokens per block (VMEM double-buffers two blocks of k and of v)."""
    cap = max(1, min(limit, 512 // max(page_size, 1), pages_per_slot))
    return max(d for d in range(1, cap + 1) if pages_per_slot % d == 0)


def check_shapes(q_shape, pages_shape, *, platform: str, name: str) -> None:
    """Refuse what the TPU kernels cannot take, naming the limit."""
    slots, q_len, hq, dh = q_shape
    kvh, _, page_size, dh_k = pages_shape
    if dh_k != dh or hq % kvh:
        raise ValueError(f"attention={name!r}: q {tuple(q_shape)} does not group over pages {tuple(pages_shape)} "
                         "([KVH, total_pages, page_size, Dh], Hq a multiple of KVH)")
    if platform == "tpu" and dh % LANES:
        raise ValueError(f"attention={name!r}: head_dim {dh} is not a multiple of {LANES} (the TPU lane width); "
                         "use the 'gather' path")
    if platform == "tpu" and page_size % 8:
        raise ValueError(f"attention={name!r}: page_size {page_size} is not a multiple of 8 (TPU sublanes)")


def query_rows(q, lengths, page_table, q_positions):
    """A q_len chunk as single-query rows: (q [slots * q_len, Hq, Dh], each row's visible
    length min(lengths, position + 1) (at least 1, so a padding query stays finite), the slot's
    page table repeated per row)."""
    slots, q_len, hq, dh = q.shape
    if q_positions is None:
        q_positions = lengths[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    seen = jnp.clip(jnp.minimum(lengths[:, None], q_positions + 1), 1, None).astype(jnp.int32)
    return q.reshape(slots * q_len, hq, dh), seen.reshape(-1), jnp.repeat(page_table, q_len, axis=0)


def _interpret_context(interpret: bool):
    if not interpret:
        return contextlib.nullcontext()
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.force_tpu_interpret_mode()


def tensor_split(mesh, kv_heads: int):
    """The mesh axis the kernel splits KV heads over ("tensor" where it divides them), or None."""
    if mesh is None or mesh.empty:
        return None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    t = sizes.get("tensor", 1)
    return "tensor" if t > 1 and kv_heads % t == 0 else None


def _local_paged(q, k_pages, v_pages, lengths, page_table, *, q_positions, block, interpret):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    slots, q_len, hq, dh = q.shape
    rows, seen, table = query_rows(q * dh ** -0.5, lengths, page_table, q_positions)
    with _interpret_context(interpret):
        out = paged_attention(rows, k_pages, v_pages, seen, table, pages_per_compute_block=block)
    return out.reshape(slots, q_len, hq, dh).astype(q.dtype)


def paged_attention_tpu(q, k_pages, v_pages, lengths, page_table, *, q_positions=None, mesh=None,
                        platform: str = "tpu", pages_per_compute_block: int | None = None,
                        interpret: bool = False):
    """The "paged_tpu" backend (module docstring); same arguments as `paged_attention_gather`."""
    check_shapes(q.shape, k_pages.shape, platform=platform, name="paged_tpu")
    pps = page_table.shape[1]
    block = pages_per_compute_block or pages_per_block(pps, k_pages.shape[2])
    if pps % block:
        raise ValueError(f"attention='paged_tpu': pages_per_compute_block {block} does not divide the "
                         f"{pps} pages per slot")
    if q_positions is None:
        q_positions = lengths[:, None] - q.shape[1] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    local = functools.partial(_local_paged, block=block, interpret=interpret)
    axis = tensor_split(mesh, k_pages.shape[0])
    if axis is None:
        return local(q, k_pages, v_pages, lengths, page_table, q_positions=q_positions)
    heads = P(None, None, axis)
    return shard_map(lambda *a: local(*a[:5], q_positions=a[5]), mesh=mesh,
                     in_specs=(heads, P(axis), P(axis), P(), P(), P()),
                     out_specs=heads)(q, k_pages, v_pages, lengths, page_table, q_positions)


def combine_pages(k_pages, v_pages):
    """The engine's split pool ([KVH, pages, page, Dh] each) as the ragged kernel's one pool
    [pages, page, 2 * KVH, Dh], k head h at 2h and v at 2h + 1. A full copy: the engine keeps
    its pool in this layout when it runs "ragged_tpu" (STORAGE_LAYOUT)."""
    kvh, n, page, dh = k_pages.shape
    return jnp.stack([k_pages, v_pages], axis=1).transpose(2, 3, 0, 1, 4).reshape(n, page, 2 * kvh, dh)


def _local_ragged(q, kv_pages, lengths, page_table, *, pages_block, queries_block, interpret):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    slots, q_len, hq, dh = q.shape
    cu_q_lens = jnp.arange(slots + 1, dtype=jnp.int32) * q_len
    with _interpret_context(interpret):
        out = ragged_paged_attention(q.reshape(slots * q_len, hq, dh), kv_pages, lengths.astype(jnp.int32),
                                     page_table.astype(jnp.int32), cu_q_lens, jnp.array([slots], jnp.int32),
                                     sm_scale=dh ** -0.5, num_kv_pages_per_block=pages_block,
                                     num_queries_per_block=queries_block)
    return out.reshape(slots, q_len, hq, dh)


def ragged_paged_attention_tpu(q, kv_pages, lengths, page_table, *, q_positions=None, mesh=None,
                               platform: str = "tpu", pages_per_block_: int | None = None,
                               queries_per_block: int | None = None, interpret: bool = False):
    """The "ragged_tpu" backend over a combined pool ([pages, page, 2 * KVH, Dh],
    `combine_pages`). q_positions must be None: the kernel's queries are the last q_len tokens
    of each slot (lengths include them)."""
    if q_positions is not None:
        raise ValueError("attention='ragged_tpu' takes each slot's queries as its last q_len tokens (the default "
                         "positions); pass q_positions=None, or use 'paged_tpu' / 'gather' for other positions")
    n, page_size, combined, dh = kv_pages.shape
    if combined % 2:
        raise ValueError(f"attention='ragged_tpu': pool {tuple(kv_pages.shape)} is not [pages, page, 2 * KVH, Dh] "
                         "(combine_pages)")
    kvh = combined // 2
    check_shapes(q.shape, (kvh, n, page_size, kv_pages.shape[-1]), platform=platform, name="ragged_tpu")
    pps = page_table.shape[1]
    pages_block = pages_per_block_ or pages_per_block(pps, page_size)
    queries_block = queries_per_block or min(32, max(8, -(-q.shape[1] * q.shape[0] // 8) * 8))
    local = functools.partial(_local_ragged, pages_block=pages_block, queries_block=queries_block,
                              interpret=interpret)
    axis = tensor_split(mesh, kvh)
    if axis is None:
        return local(q, kv_pages, lengths, page_table)
    return shard_map(local, mesh=mesh, in_specs=(P(None, None, axis), P(None, None, axis), P(), P()),
                     out_specs=P(None, None, axis))(q, kv_pages, lengths, page_table)


__all__ = ["LANES", "STORAGE_LAYOUT", "check_shapes", "combine_pages", "paged_attention_tpu", "pages_per_block",
           "query_rows", "ragged_paged_attention_tpu", "tensor_split"]
