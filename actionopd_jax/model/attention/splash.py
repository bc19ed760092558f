"""The "splash" implementation: Pallas splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`), causal or shared-prefix, grouped-query
(one MQA kernel per KV head), padding through segment ids. Never materialises a [T, T] score
matrix. On CPU it runs in Pallas interpret mode (tests only). The mesh comes in explicitly:
the kernel is split over it by hand (shard_map), rows over data/fsdp, KV heads over tensor."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from actionopd_jax.model.attention.names import ATTENTION_OUT
from actionopd_jax.model.attention.shared_prefix import SharedPrefix
from actionopd_jax.jax_compat import shard_map

_SPLASH_BLOCK = 512  # q / kv tile; MaxText's default for long sequences


def _splash_block(t: int) -> int:
    """Largest tile (<= _SPLASH_BLOCK, multiple of 128) that divides the padded length."""
    for blk in (_SPLASH_BLOCK, 256, 128):
        if t % blk == 0:
            return blk
    raise AssertionError(t)


def _dkv_block(t: int) -> int:
    """KV block of the fused backward: two compute tiles where they divide the padded length.
    The dkv kernel writes one dq partial per KV block ([heads, T / block, T, Dh], summed
    after), quadratic in T: with one 512-key tile a block, the TPU recipe's 40,960-token rows
    held 25 GiB of them a chip in one layer's backward (the update compiled for v5p: 69.4
    GiB a chip; 56.9 with two tiles). Four tiles (50.6 GiB) ran out of the kernel's scoped
    VMEM in the 1- and 2-layer compiles of `--check --aot`. Not timed on a TPU."""
    blk = _splash_block(t)
    return next(blk * m for m in (2, 1) if t % (blk * m) == 0)


def backward_dq_bytes(t: int, heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of the fused backward's dq partials for rows of t tokens and `heads` query heads
    on a device (_dkv_block): 128 MiB at 4,096 tokens and the 4B's 32 heads, 12.5 GiB at the
    TPU recipe's 40,960 (train/plan.py counts them)."""
    padded = -(-t // 128) * 128
    return heads * (padded // _dkv_block(padded)) * padded * head_dim * itemsize


def _layout_mask(t: int, layout: SharedPrefix | None):
    """The kernel's mask for rows of t tokens (t >= layout.length: the tail is padding)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if layout is None:
        return sm.CausalMask((t, t))

    class SharedPrefixMask(sm._ComputableMask):  # computed inside the kernel, never stored
        def __init__(self):
            super().__init__(shape=(t, t), mask_function=layout.visible)

        def __eq__(self, other):
            return isinstance(other, SharedPrefixMask) and other.shape == self.shape

        def __hash__(self):
            return hash((SharedPrefixMask, self.shape, layout))

    return SharedPrefixMask()


def _splash_kernel(t: int, groups: int, interpret: bool, layout: SharedPrefix | None = None):
    """One MQA kernel for sequences of t tokens and `groups` query heads per KV head, causal or
    shared-prefix. Built at every trace, not cached: the kernel holds its block tables as jax
    arrays, which belong to the trace that made them."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    blk = _splash_block(t)
    sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk,
                          block_q_dkv=blk, block_kv_dkv=_dkv_block(t), block_kv_dkv_compute=blk,
                          use_fused_bwd_kernel=True)
    mask = sm.MultiHeadMask([_layout_mask(t, layout) for _ in range(groups)])
    return sk.make_splash_mqa(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret,
                              residual_checkpoint_name=ATTENTION_OUT)


def _splash_local(q, k, v, segments, dtype, interpret: bool, layout: SharedPrefix | None):
    """Per-device splash: q [b, T, KVH, G, Dh], k/v [b, T, KVH, Dh], segments i32 [b, T]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, t, kvh, g, dh = q.shape
    kernel = _splash_kernel(t, g, interpret, layout)
    qh = (q * dh ** -0.5).astype(dtype).transpose(0, 2, 3, 1, 4)   # [b, KVH, G, T, Dh]
    kh = k.astype(dtype).transpose(0, 2, 1, 3)                      # [b, KVH, T, Dh]
    vh = v.astype(dtype).transpose(0, 2, 1, 3)

    def one(qi, ki, vi, seg):
        return kernel(qi, ki, vi, segment_ids=sk.SegmentIds(q=seg, kv=seg))

    out = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(qh, kh, vh, segments)
    return out.transpose(0, 3, 1, 2, 4).astype(dtype)


def splash_attention(q, k, v, key_mask, dtype, *, mesh, interpret: bool, layout: SharedPrefix | None = None):
    """Splash over `mesh` (an abstract or concrete mesh; empty or one device: no manual split)."""
    b, t, kvh, g, dh = q.shape
    # padding keys (and the tail added to reach a tile multiple) form segment 0: real queries
    # (segment 1) never see them; pad queries see only pads and are ignored
    padded = -(-t // 128) * 128
    segments = key_mask.astype(jnp.int32)
    if padded != t:
        widths = ((0, 0), (0, padded - t))
        q = jnp.pad(q, widths + ((0, 0),) * 3)
        k, v = (jnp.pad(x, widths + ((0, 0),) * 2) for x in (k, v))
        segments = jnp.pad(segments, widths)
    local = functools.partial(_splash_local, dtype=dtype, interpret=interpret, layout=layout)
    if mesh.empty or mesh.size == 1:
        out = local(q, k, v, segments)
    else:
        rows, heads = _split_axes(mesh, b, kvh)
        out = shard_map(local, mesh=mesh,
                        in_specs=(P(rows, None, heads), P(rows, None, heads), P(rows, None, heads), P(rows)),
                        out_specs=P(rows, None, heads))(q, k, v, segments)
    return out[:, :t]


def _split_axes(mesh, rows: int, kv_heads: int):
    """Mesh axes for the kernel's manual split: rows over data/fsdp, KV heads over tensor,
    each only where it divides (the kernel needs whole rows and whole heads per device)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    row_axes = []
    for a in ("data", "fsdp"):
        if sizes.get(a, 1) > 1 and rows % (math.prod(sizes[x] for x in row_axes) * sizes[a]) == 0:
            row_axes.append(a)
    head_axis = "tensor" if sizes.get("tensor", 1) > 1 and kv_heads % sizes["tensor"] == 0 else None
    return (tuple(row_axes) or None), head_axis
