"""Paged attention over live pages only: the engine's CPU path.

`paged_gather.paged_attention_gather` gathers every slot's whole page table (max_len keys) at
every call, whatever the slots hold. Here the table is read in blocks of `block_pages` pages,
in a loop that stops after the block holding the longest slot's last key, with an online
(running max / running sum) softmax across blocks, so a step costs what the live slots have
filled, and the compiled program is the same whatever the request mix (the block count is
traced data). Same arguments and result as `paged_attention_gather` (its docstring for the
shapes); scores and softmax in float32. The result differs from the gather path by float32
rounding only (the softmax is normalised once at the end instead of per key).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from actionopd_jax.model.attention.paged_gather import default_positions
from actionopd_jax.model.attention.reference import MASK_VALUE

BLOCK_TOKENS = 128      # keys per block: big enough for the loop's overhead to vanish, small enough to skip


def block_pages_for(page_size: int, pages_per_slot: int, block_tokens: int = BLOCK_TOKENS) -> int:
    return max(1, min(pages_per_slot, block_tokens // max(page_size, 1)))


def paged_attention_live(q, k_pages, v_pages, lengths, page_table, *, q_positions=None, block_pages=None):
    return merge_parts([live_part(q, k_pages, v_pages, lengths, page_table, q_positions=q_positions,
                                  block_pages=block_pages)], q.dtype)


def live_part(q, k_pages, v_pages, lengths, page_table, *, q_positions=None, block_pages=None):
    """The online softmax's unnormalised state over one slot's pages: (top, total, acc), each
    [S, KVH, G, T(, Dh)], float32; `merge_parts` combines parts over disjoint key sets (the
    engine's shared-prompt pass and per-slot pass) into the attention output."""
    slots, q_len, hq, dh = q.shape
    kvh, _, page, _ = k_pages.shape
    pps = page_table.shape[1]
    bp = block_pages or block_pages_for(page, pps)
    n_blocks_max = -(-pps // bp)
    if n_blocks_max * bp != pps:          # pad the table to whole blocks (null page; masked by lengths)
        page_table = jnp.pad(page_table, ((0, 0), (0, n_blocks_max * bp - pps)))
    if q_positions is None:
        q_positions = default_positions(lengths, q_len)
    width = bp * page
    n_blocks = jnp.minimum((jnp.max(lengths) + width - 1) // width, n_blocks_max)
    dtype = q.dtype
    qg = q.reshape(slots, q_len, kvh, hq // kvh, dh)
    scale = dh ** -0.5

    def block(b, carry):
        top, total, acc = carry
        cols = jax.lax.dynamic_slice_in_dim(page_table, b * bp, bp, axis=1).reshape(-1)
        k = jnp.take(k_pages, cols, axis=1).reshape(kvh, slots, width, dh).astype(dtype)
        v = jnp.take(v_pages, cols, axis=1).reshape(kvh, slots, width, dh).astype(dtype)
        key_pos = b * width + jnp.arange(width, dtype=jnp.int32)
        visible = (key_pos[None, None, :] <= q_positions[:, :, None]) & \
            (key_pos[None, None, :] < lengths[:, None, None])                     # [S, T, C]
        scores = jnp.einsum("stkgd,kscd->skgtc", qg, k, preferred_element_type=jnp.float32) * scale
        scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
        new_top = jnp.maximum(top, scores.max(-1))
        fix = jnp.exp(top - new_top)
        e = jnp.exp(scores - new_top[..., None])
        total = total * fix + e.sum(-1)
        acc = acc * fix[..., None] + jnp.einsum("skgtc,kscd->skgtd", e.astype(dtype), v,
                                                preferred_element_type=jnp.float32)
        return new_top, total, acc

    shape = (slots, kvh, hq // kvh, q_len)
    init = (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (dh,), jnp.float32))
    return jax.lax.fori_loop(0, n_blocks, block, init)


def merge_parts(parts, dtype):
    """[(top, total, acc)] over disjoint keys -> the attention output [S, T, Hq, Dh]."""
    top = parts[0][0]
    for p in parts[1:]:
        top = jnp.maximum(top, p[0])
    total = sum(p[1] * jnp.exp(p[0] - top) for p in parts)
    acc = sum(p[2] * jnp.exp(p[0] - top)[..., None] for p in parts)
    out = (acc / total[..., None]).astype(dtype)                                  # [S, KVH, G, T, Dh]
    slots, kvh, g, q_len, dh = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(slots, q_len, kvh * g, dh)


__all__ = ["BLOCK_TOKENS", "block_pages_for", "live_part", "merge_parts", "paged_attention_live"]
