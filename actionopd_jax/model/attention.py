"""Causal self-attention of a whole sequence, one switch over per-platform kernels.

`Qwen3Config.attention` (config: `model.attention`) picks the implementation:

- "auto": splash on TPU, cudnn on GPU, cpu on CPU, decided by the platform of the mesh the
  program is traced under (`jax.set_mesh`), so a CPU host compiling for a TPU topology picks
  the TPU kernel; without a mesh, by `jax.default_backend()`.
- "splash": Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`),
  causal, grouped-query (one MQA kernel per KV head), padding through segment ids. Never
  materialises a [T, T] score matrix. On CPU it runs in Pallas interpret mode (tests only).
- "cudnn": cuDNN flash attention through `jax.nn.dot_product_attention`; padding by
  sequence lengths, so rows must be right-padded (the trainer's layout).
- "xla": `jax.nn.dot_product_attention(implementation="xla")`, the reference: materialises
  the scores, any padding.
- "cpu": `layers.causal_attend`, the blocked path that is fastest on CPU XLA.

Every implementation takes q [B, T, KVH, G, Dh], k/v [B, T, KVH, Dh], key_mask bool [B, T]
(False = padding key) and returns [B, T, KVH, G, Dh] in `dtype`: the same result at every
query that sees at least one key (tests/test_attention_impls.py checks forward and
gradients against `layers.attend`). Queries of padding positions get some finite value.

Shared-prefix rows (`SharedPrefix`): one packed row holds a state's prompt once, then its N
candidate responses in fixed-width regions; a response token sees the prompt and the earlier
tokens of its own response only. The N rows of a state then cost one prompt instead of N
(a 24k-token prompt with 4 x 4k responses: 40k tokens instead of 4 x 28k).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from actionopd_jax.model.layers import attend, causal_attend

IMPLEMENTATIONS = ("auto", "splash", "cudnn", "xla", "cpu")
# checkpoint name of what the attention backward needs (remat policies "attn" / "offload" keep
# it): splash's residuals (output, log-sum-exp), the attention output of the other kernels
ATTENTION_OUT = "attention_out"
_AUTO = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn", "rocm": "xla", "cpu": "cpu"}


def target_platform() -> str:
    """Platform of the devices the current program is traced for: the ambient mesh's, else
    the default backend (a CPU host compiling for a TPU mesh answers "tpu")."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh.abstract_device.platform
    return jax.default_backend()


def resolve(impl: str, platform: str | None = None) -> str:
    """The concrete implementation "auto" (or an explicit choice) means on `platform`."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention={impl!r}; expected one of {IMPLEMENTATIONS}")
    platform = platform or target_platform()
    if impl == "auto":
        return _AUTO.get(platform, "xla")
    if impl == "cudnn" and platform not in ("gpu", "cuda"):
        raise ValueError(f"attention='cudnn' needs an NVIDIA GPU; this program targets {platform!r} "
                         "(use 'auto', 'xla', or 'splash' on TPU)")
    if impl == "splash" and platform not in ("tpu", "cpu"):
        raise ValueError(f"attention='splash' is a TPU kernel (CPU runs it interpreted, for tests); "
                         f"this program targets {platform!r}")
    return impl


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    """Layout of a packed row: a prompt region of `prompt` slots, then `count` response regions
    of `response` slots each (every region left-aligned, padding after; padding is excluded by
    the key mask). Static: it is part of the compiled program's shape."""

    prompt: int
    response: int
    count: int

    @property
    def length(self) -> int:
        return self.prompt + self.count * self.response

    def region(self, ids):
        """0 for the prompt, i + 1 for response i (comparisons only: runs inside the kernel)."""
        r = (ids >= self.prompt).astype(np.int32)
        for i in range(1, self.count):
            r = r + (ids >= self.prompt + i * self.response).astype(np.int32)
        return r

    def visible(self, q_ids, kv_ids):
        """Causal, and a response key only for queries of the same response."""
        return (kv_ids <= q_ids) & ((kv_ids < self.prompt) | (self.region(q_ids) == self.region(kv_ids)))

    def dense(self) -> np.ndarray:
        ids = np.arange(self.length, dtype=np.int32)
        return self.visible(ids[:, None], ids[None, :])


def causal_self_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array, dtype,
                          impl: str = "auto", shared_prefix: SharedPrefix | None = None) -> jax.Array:
    """Causal attention with padding keys excluded; see the module docstring for shapes.
    shared_prefix: the rows are packed that way (T == shared_prefix.length)."""
    impl = resolve(impl)
    if shared_prefix is not None and shared_prefix.length != q.shape[1]:
        raise ValueError(f"shared-prefix layout of {shared_prefix.length} tokens for rows of {q.shape[1]}")
    if impl == "splash":
        return _splash(q, k, v, key_mask, dtype, interpret=target_platform() == "cpu", layout=shared_prefix)
    if shared_prefix is not None:
        if impl == "cudnn":
            raise ValueError("shared-prefix rows need a kernel with arbitrary masks: splash (TPU) or xla; "
                             "cuDNN flash attention takes causal + padding only (set train.shared_prompt=false)")
        # the reference path: the layout's [T, T] mask, materialised
        full = jnp.asarray(shared_prefix.dense())[None] & key_mask[:, None, :]
        out = attend(q, k, v, full, dtype)
    elif impl == "cpu":
        out = causal_attend(q, k, v, key_mask, dtype)
    else:
        out = _dot_product(q, k, v, key_mask, dtype, impl)
    return checkpoint_name(out, ATTENTION_OUT)


# ---- jax.nn.dot_product_attention (xla reference, cuDNN flash) ----------------------------
def _dot_product(q, k, v, key_mask, dtype, implementation: str):
    b, t, kvh, g, dh = q.shape
    qf = q.reshape(b, t, kvh * g, dh).astype(dtype)
    if implementation == "cudnn":
        # cuDNN takes padding as lengths: valid keys are a prefix (right-padded rows)
        lengths = key_mask.sum(-1).astype(jnp.int32)
        out = jax.nn.dot_product_attention(qf, k.astype(dtype), v.astype(dtype), is_causal=True,
                                           query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                           implementation="cudnn")
    else:
        out = jax.nn.dot_product_attention(qf, k.astype(dtype), v.astype(dtype), is_causal=True,
                                           mask=key_mask[:, None, None, :], implementation="xla")
    return out.reshape(b, t, kvh, g, dh).astype(dtype)


# ---- splash attention (Pallas, TPU) -------------------------------------------------------
_SPLASH_BLOCK = 512  # q / kv tile; MaxText's default for long sequences


def _splash_block(t: int) -> int:
    """Largest tile (<= _SPLASH_BLOCK, multiple of 128) that divides the padded length."""
    for blk in (_SPLASH_BLOCK, 256, 128):
        if t % blk == 0:
            return blk
    raise AssertionError(t)


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
                          block_q_dkv=blk, block_kv_dkv=blk, block_kv_dkv_compute=blk,
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


def _splash(q, k, v, key_mask, dtype, *, interpret: bool, layout: SharedPrefix | None = None):
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
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        out = local(q, k, v, segments)
    else:
        rows, heads = _split_axes(mesh, b, kvh)
        out = jax.shard_map(local, mesh=mesh,
                            in_specs=(P(rows, None, heads), P(rows, None, heads), P(rows, None, heads),
                                      P(rows)),
                            out_specs=P(rows, None, heads), check_vma=False)(q, k, v, segments)
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
