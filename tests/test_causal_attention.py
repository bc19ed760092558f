"""Block-causal attention (the no-cache forward of the model) equals dense masked attention
at every query that sees a key, in values and gradients, for lengths that split into 1 and 3
blocks, with left and right padding (in one block, and across block boundaries)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actionopd_jax.model.layers import attend, causal_attend, causal_blocks


@pytest.mark.parametrize("t, want", [(64, 1), (100, 1), (128, 2), (192, 3), (640, 10), (2048, 16), (4096, 16),
                                     (4100, 10)])
def test_block_count(t, want):
    assert causal_blocks(t) == want and t % want == 0


# 1 block, pads inside it; 3 blocks of 64, the left pad covering all of block 0 and part of
# block 1 (whole query blocks that see no key) and the right pad starting inside block 1 (a
# suffix of keys masked across a boundary). More blocks (10 at 640) repeat the same per-block
# program and cost minutes eagerly; each case is jitted whole, as the model runs it.
@pytest.mark.parametrize("t, left, right", [(100, 37, 50), (192, 70, 100)])
def test_equals_dense_masked_attention(t, left, right):
    b, kvh, g, dh = 3, 2, 2, 16
    ks = jax.random.split(jax.random.key(t), 4)
    q = jax.random.normal(ks[0], (b, t, kvh, g, dh))
    k = jax.random.normal(ks[1], (b, t, kvh, dh))
    v = jax.random.normal(ks[2], (b, t, kvh, dh))
    key_mask = jnp.ones((b, t), bool).at[0, :left].set(False).at[1, t - right:].set(False)  # left / right pad
    mask = jnp.tril(jnp.ones((t, t), bool))[None] & key_mask[:, None, :]
    sees_a_key = mask.any(-1)[:, :, None, None, None]
    w = jax.random.normal(ks[3], (b, t, kvh, g, dh)) * sees_a_key

    assert causal_blocks(t) == (1 if t < 128 else 3)
    dense = jax.jit(attend, static_argnums=4)(q, k, v, mask, jnp.float32)
    blocked = jax.jit(causal_attend, static_argnums=4)(q, k, v, key_mask, jnp.float32)
    assert float(jnp.abs(jnp.where(sees_a_key, dense - blocked, 0)).max()) < 1e-5
    assert bool(jnp.isfinite(blocked).all())

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * w).sum()

    gd = jax.jit(jax.grad(loss(lambda q, k, v: attend(q, k, v, mask, jnp.float32)), (0, 1, 2)))(q, k, v)
    gb = jax.jit(jax.grad(loss(lambda q, k, v: causal_attend(q, k, v, key_mask, jnp.float32)), (0, 1, 2)))(q, k, v)
    for a, c in zip(gd, gb):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), atol=1e-5)
