"""The "cudnn" implementation: cuDNN flash attention through `jax.nn.dot_product_attention`.

Padding goes in as sequence lengths, so valid keys must be a prefix of each row (right-padded
rows: the trainer's layout; the sampler right-aligns its prompts for it, sampling/decode.py
`prefill_layout`). Causal + padding only: no shared-prefix masks (refused in `resolve`).

What cuDNN takes (jax 0.10.2, `jax._src.cudnn.fused_attention_stablehlo`, bf16/fp16 path),
checked by `cudnn_refusal` before anything is traced so the refusal names the setting:
- compute dtype bfloat16 or float16;
- head dim a multiple of 8 and at most 128 (256 on Hopper; jax allows only 128 when it
  cannot see the GPU, as when lowering on a CPU host, and every Qwen3 size uses 128);
- query heads a multiple of KV heads (grouped-query: query head n reads KV head n // (H/KVH),
  the order `q.reshape(b, t, kvh * g, dh)` produces);
- no sequence multiple for causal + padding without a bias (an even length is needed only
  with a bias in training, which we never pass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128


def cudnn_refusal(*, heads: tuple[int, int, int] | None = None, dtype=None) -> str:
    """Why cuDNN flash attention cannot run these shapes ("" when it can). heads: (query
    heads, KV heads, head dim); dtype: the compute dtype."""
    reasons = []
    if dtype is not None and jnp.dtype(dtype).name not in CUDNN_DTYPES:
        reasons.append(f"compute dtype {jnp.dtype(dtype).name} (cuDNN runs {' or '.join(CUDNN_DTYPES)}: "
                       "set model.dtype=bfloat16)")
    if heads is not None:
        q_heads, kv_heads, head_dim = heads
        if kv_heads <= 0 or q_heads % kv_heads:
            reasons.append(f"{q_heads} query heads over {kv_heads} KV heads (grouped-query attention needs "
                           "the query heads to be a multiple of the KV heads)")
        if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
            reasons.append(f"head dim {head_dim} (cuDNN needs a multiple of 8, at most {CUDNN_MAX_HEAD_DIM})")
    return "; ".join(reasons)


def cudnn_attention(q, k, v, key_mask, dtype):
    b, t, kvh, g, dh = q.shape
    qf = q.reshape(b, t, kvh * g, dh).astype(dtype)
    # cuDNN takes padding as lengths: valid keys are a prefix (right-padded rows)
    lengths = key_mask.sum(-1).astype(jnp.int32)
    out = jax.nn.dot_product_attention(qf, k.astype(dtype), v.astype(dtype), is_causal=True,
                                       query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                       implementation="cudnn")
    return out.reshape(b, t, kvh, g, dh).astype(dtype)
