"""The "cudnn" implementation: cuDNN flash attention through `jax.nn.dot_product_attention`.

Padding goes in as sequence lengths, so valid keys must be a prefix of each row (right-padded
rows: the trainer's layout; the sampler right-aligns its prompts for it, sampling/decode.py
`prefill_layout`). Causal + padding only: no shared-prefix masks (refused in `resolve`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cudnn_attention(q, k, v, key_mask, dtype):
    b, t, kvh, g, dh = q.shape
    qf = q.reshape(b, t, kvh * g, dh).astype(dtype)
    # cuDNN takes padding as lengths: valid keys are a prefix (right-padded rows)
    lengths = key_mask.sum(-1).astype(jnp.int32)
    out = jax.nn.dot_product_attention(qf, k.astype(dtype), v.astype(dtype), is_causal=True,
                                       query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                       implementation="cudnn")
    return out.reshape(b, t, kvh, g, dh).astype(dtype)
