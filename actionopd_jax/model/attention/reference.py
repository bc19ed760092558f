"""The reference attention: grouped-query scores against an explicit [T, S] mask, materialised.

Every other kernel is tested against `attend` (tests/test_attention_impls.py). It is also what
the model's cached forward runs (`Qwen3.__call__` with a KVCache) and the "xla" path of
shared-prefix rows (the layout's dense mask).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Large negative instead of -inf: a query with no visible key (a left-pad row) then gets a
# uniform softmax over masked keys, which is finite and ignored, rather than NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dtype) -> jax.Array:
    """Grouped-query attention.

    q: [B, T, KVH, G, Dh]; k, v: [B, S, KVH, Dh]; mask: bool [B, T, S] (True = may attend).
    Scores and softmax in float32; returns [B, T, KVH, G, Dh] in `dtype`.
    """
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(dtype))
