"""The "xla" implementation: `jax.nn.dot_product_attention(implementation="xla")`, the reference
kernel of XLA (materialises the scores; any padding)."""

from __future__ import annotations

import jax


def xla_attention(q, k, v, key_mask, dtype):
    b, t, kvh, g, dh = q.shape
    qf = q.reshape(b, t, kvh * g, dh).astype(dtype)
    out = jax.nn.dot_product_attention(qf, k.astype(dtype), v.astype(dtype), is_causal=True,
                                       mask=key_mask[:, None, None, :], implementation="xla")
    return out.reshape(b, t, kvh, g, dh).astype(dtype)
