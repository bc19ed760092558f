"""Paged attention, the plain path: gather each slot's pages, then dense grouped-query attention.

The continuous-batching engine (actionopd_jax/engine) keeps keys/values in a pool of fixed-size
pages shared by all slots; a slot's page table lists the pages holding its tokens in order.
Layout (the one jax's Pallas paged-attention kernels take, so the TPU/GPU backends in
paged_tpu.py / paged_gpu.py read the same pool):

- k_pages, v_pages: [KVH, total_pages, page_size, Dh] (one layer);
- page_table: int32 [num_slots, pages_per_slot] (unused entries may name any page, e.g. the
  reserved null page 0: they are masked by `lengths`);
- lengths: int32 [num_slots], the tokens in the cache for that slot, the query tokens
  included (they are written before attention);
- q: [num_slots, q_len, Hq, Dh]; query head h belongs to KV head h // (Hq // KVH), as the
  model groups them (`Attention.group_queries`).
- q_positions: int32 [num_slots, q_len], each query's absolute position: it sees keys at
  positions <= its own and < lengths. Default: the last q_len positions before `lengths`.

This path materialises the gathered keys ([num_slots, pages_per_slot * page_size] per head),
which is what makes it the reference and the CPU path: scores and softmax in float32, as the
model's attention (reference.py), a slot with nothing visible gets a finite junk output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from actionopd_jax.model.attention.reference import MASK_VALUE


def default_positions(lengths: jax.Array, q_len: int) -> jax.Array:
    """The positions of the last q_len tokens of each slot: lengths - q_len + [0, q_len)."""
    return lengths[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None, :]


def _gather(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """[KVH, P, page, Dh] pool, [S, pps] table -> [KVH, S, pps * page, Dh] (the pool's own
    axis order: one gather, no transposed copy)."""
    kvh, _, page, dh = pages.shape
    slots, pps = page_table.shape
    return jnp.take(pages, page_table.reshape(-1), axis=1).reshape(kvh, slots, pps * page, dh)


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """[KVH, P, page, Dh] pool, [S, pps] table -> [S, pps * page, KVH, Dh]: each slot's tokens
    in position order (the model's cache layout; for tests and callers that want it)."""
    return _gather(pages, page_table).transpose(1, 2, 0, 3)


def paged_attention_gather(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                           page_table: jax.Array, *, q_positions: jax.Array | None = None) -> jax.Array:
    """Causal attention of q over each slot's paged keys/values (module docstring for shapes).
    Returns [num_slots, q_len, Hq, Dh] in q's dtype."""
    slots, q_len, hq, dh = q.shape
    kvh = k_pages.shape[0]
    if k_pages.shape != v_pages.shape or k_pages.ndim != 4 or k_pages.shape[-1] != dh:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be "
                         f"[KVH, total_pages, page_size, {dh}]")
    if hq % kvh:
        raise ValueError(f"{hq} query heads do not group over {kvh} KV heads")
    if page_table.shape[0] != slots or lengths.shape != (slots,):
        raise ValueError(f"page_table {page_table.shape} and lengths {lengths.shape} must have one row per "
                         f"slot ({slots})")
    if q_positions is None:
        q_positions = default_positions(lengths, q_len)
    dtype = q.dtype
    k = _gather(k_pages, page_table).astype(dtype)                   # [KVH, S, C, Dh]
    v = _gather(v_pages, page_table).astype(dtype)
    key_pos = jnp.arange(k.shape[2], dtype=jnp.int32)
    visible = (key_pos[None, None, :] <= q_positions[:, :, None]) & (key_pos[None, None, :] < lengths[:, None, None])
    qg = q.reshape(slots, q_len, kvh, hq // kvh, dh)
    scores = jnp.einsum("stkgd,kscd->skgtc", qg, k, preferred_element_type=jnp.float32) * dh ** -0.5
    scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("skgtc,kscd->stkgd", probs, v)
    return out.reshape(slots, q_len, hq, dh)


__all__ = ["default_positions", "gather_pages", "paged_attention_gather"]
