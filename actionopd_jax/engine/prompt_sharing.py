"""Prompt sharing in the engine's decode segment: the SHARE_WIDTH samples of one prompt read
its pages once a step. Their queries attend over the prompt's whole pages in one pass, each row
over its own pages (its reply, and the prompt's copied last page) in a second, and the two
online-softmax states are merged (paged_live.merge_parts). The host lays the rows out
(groups.arrange); the program reshapes, so it gathers no queries and selects no branch.

At the device check's 256-row workload (64 prompts x 4 samples) a step reads each prompt once
instead of 4 times: the HBM bound itself counts a shared prompt once. Backends: the CPU live
path (paged_live.py) and the GPU kernel (paged_gpu_parts.py); the others read per slot."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from actionopd_jax.model.attention.dispatch import abstract_mesh, target_platform
from actionopd_jax.model.attention.paged_gpu_parts import paged_parts_gpu
from actionopd_jax.model.attention.paged_live import MASK_VALUE, block_pages_for, live_part, merge_parts

SHARE_WIDTH = 4   # samples of one prompt whose queries share one read of its pages
SHARED_BLOCK_TOKENS = 512   # keys per block of the CPU shared pass (fewer, larger blocks: measured
                            # 0.58 vs 0.74 ms per layer-step at 128, bench-tiny, 8 x 512-token prompts)
SHARED_ATTENTION = ("live", "paged_gpu")   # the backends whose passes return mergeable parts


@flax.struct.dataclass
class Groups:
    """Prompt sharing in a decode segment (the static CPU backend's shared prompt, on pages),
    for the backends of SHARED_ATTENTION: the CPU live path and the GPU kernel. The segment's
    rows are blocks of SHARE_WIDTH (row r: member r % SHARE_WIDTH of block r // SHARE_WIDTH;
    rows past the last whole block are in none). Block b's queries attend over `table[b]`'s
    pages, `length[b]` tokens (0: none) in one pass, each row attends over its own pages
    (`own_table`: its table past the first `own_start` tokens) in a second, and the two
    online-softmax states are merged. A row with own_start 0 (a sample not sharing, or an idle
    row) has everything in its own pass (groups.arrange builds these)."""

    table: jax.Array        # i32[B, pages_per_slot]: the block's shared prompt pages, null-padded
    length: jax.Array       # i32[B]: shared tokens (whole pages)
    own_start: jax.Array    # i32[S]: tokens of the row's cache in its block's pass
    own_table: jax.Array    # i32[S, pages_per_slot]: the row's pages from own_start on, null-padded


def attend_parts(q, pk, pv, lengths, table, *, attention: str, wide: bool = False):
    """The online softmax's parts (paged_live.live_part's (top, total, acc)) of attention in
    which each row's T queries all see its first `lengths` keys. wide: the shared pass (the
    CPU path then reads larger blocks)."""
    if attention == "paged_gpu":
        mesh = abstract_mesh(None)
        return paged_parts_gpu(q, pk, pv, lengths, table, mesh=mesh, interpret=target_platform(mesh) == "cpu")
    positions = jnp.broadcast_to(lengths[:, None] - 1, q.shape[:2])
    block_pages = block_pages_for(pk.shape[2], table.shape[1], SHARED_BLOCK_TOKENS) if wide else None
    return live_part(q, pk, pv, lengths, table, q_positions=positions, block_pages=block_pages)


def shared_attend(q, pk, pv, lengths, groups: Groups, shift, attention: str = "live"):
    """Decode attention with each block's prompt pages read once (Groups)."""
    n_rows, n_blocks = q.shape[0], groups.length.shape[0]
    own = attend_parts(q, pk, pv, lengths - groups.own_start, groups.own_table + shift, attention=attention)
    if n_blocks == 0:
        return merge_parts([own], q.dtype)
    inner = n_blocks * SHARE_WIDTH
    qm = q[:inner, 0].reshape(n_blocks, SHARE_WIDTH, *q.shape[2:])          # the block's queries as its "tokens"
    parts = attend_parts(qm, pk, pv, groups.length, groups.table + shift, attention=attention,
                          wide=True)                                          # [B, KVH, Gq, W(, Dh)]

    def by_row(x, fill):                                                      # -> [S, KVH, Gq, 1(, Dh)]
        x = jnp.moveaxis(x, 3, 1).reshape(inner, *x.shape[1:3], 1, *x.shape[4:])
        return jnp.pad(x, [(0, n_rows - inner)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)

    inside = (groups.own_start > 0)[:, None, None, None]
    top, total, acc = parts
    shared = (jnp.where(inside, by_row(top, MASK_VALUE), MASK_VALUE), jnp.where(inside, by_row(total, 0.0), 0.0),
              jnp.where(inside[..., None], by_row(acc, 0.0), 0.0))
    return merge_parts([shared, own], q.dtype)


__all__ = ["SHARED_ATTENTION", "SHARED_BLOCK_TOKENS", "SHARE_WIDTH", "Groups", "attend_parts", "shared_attend"]
