"""The fused LM head (online log-sum-exp over vocabulary chunks, custom VJP): values and
gradients by hand on a 3-token vocabulary, then against the plain logits path on random
shapes (padding of the last chunk, temperatures, repeated targets), and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actionopd_jax.train.head_logprobs import head_logprobs
from actionopd_jax.train.losses import token_logprobs


def test_three_token_vocabulary_by_hand():
    # logits = h @ w.T = [1, 0, -1]; chunk 2 leaves one padded slot in the second chunk
    h = jnp.array([[1.0, 0.0]])
    w = jnp.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    t = jnp.array([0])
    # log p(0) = 1 - log(e + 1 + 1/e) = 1 - log(4.086161269) = -0.407605964
    assert float(head_logprobs(h, w, t, 1.0, chunk=2)[0]) == pytest.approx(-0.407605964, abs=1e-6)
    # p = (0.665241, 0.244728, 0.090031); d/dh = w0 - sum_j p_j w_j = (1 - p0 + p2, -p1)
    gh, gw = jax.grad(lambda h, w: head_logprobs(h, w, t, 1.0, chunk=2).sum(), (0, 1))(h, w)
    np.testing.assert_allclose(np.asarray(gh), [[0.424790, -0.244728]], atol=1e-5)
    # d/dw_j = (delta(j, 0) - p_j) h
    np.testing.assert_allclose(np.asarray(gw), [[0.334759, 0], [-0.244728, 0], [-0.090031, 0]], atol=1e-5)
    # temperature 2: logits / 2 = [0.5, 0, -0.5]; log p(2) = -0.5 - log(e^.5 + 1 + e^-.5) = -0.5 - 1.180270 = -1.680270
    assert float(head_logprobs(h, w, jnp.array([2]), 2.0, chunk=2)[0]) == pytest.approx(-1.680270, abs=1e-5)


@pytest.mark.parametrize("vocab, chunk, temperature", [(37, 8, 0.7), (64, 64, 1.0), (100, 1000, 0.6), (257, 16, 1.3)])
def test_equals_plain_log_softmax_values_and_gradients(vocab, chunk, temperature):
    k = jax.random.split(jax.random.key(vocab), 4)
    h = jax.random.normal(k[0], (3, 5, 16))
    w = jax.random.normal(k[1], (vocab, 16)) * 0.5
    t = jax.random.randint(k[2], (3, 5), 0, vocab).at[0, :3].set(vocab - 1)  # repeats, last id
    g = jax.random.normal(k[3], (3, 5))

    def plain(h, w):
        return (token_logprobs(jnp.einsum("...d,vd->...v", h, w), t, temperature) * g).sum()

    def fused(h, w):
        return (head_logprobs(h, w, t, temperature, chunk=chunk) * g).sum()

    np.testing.assert_allclose(np.asarray(head_logprobs(h, w, t, temperature, chunk=chunk)),
                               np.asarray(token_logprobs(jnp.einsum("...d,vd->...v", h, w), t, temperature)),
                               atol=2e-5)
    (vp, gp), (vf, gf) = (jax.value_and_grad(f, (0, 1))(h, w) for f in (plain, fused))
    assert float(vf) == pytest.approx(float(vp), rel=1e-5, abs=1e-5)
    for a, b in zip(gp, gf):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5)
    # jitted, the same
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(fused, (0, 1)))(h, w)[1]), np.asarray(gp[1]), atol=2e-5)


def test_bf16_operands_stay_close_and_return_float32():
    k = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(k[0], (4, 32))
    w = jax.random.normal(k[1], (300, 32)) * 0.2
    t = jax.random.randint(k[2], (4,), 0, 300)
    out = head_logprobs(h, w, t, 1.0, chunk=64, dot_dtype=jnp.bfloat16)
    assert out.dtype == jnp.float32
    ref = token_logprobs(h @ w.T, t)
    assert float(jnp.abs(out - ref).max()) < 5e-2


def test_errors_name_the_problem():
    h, w = jnp.zeros((2, 4)), jnp.zeros((10, 4))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        head_logprobs(h, w, jnp.zeros((2,), jnp.int32), 0.0)
    with pytest.raises(ValueError, match="chunk must be > 0"):
        head_logprobs(h, w, jnp.zeros((2,), jnp.int32), 1.0, chunk=0)
    with pytest.raises(ValueError, match="targets"):
        head_logprobs(h, w, jnp.zeros((3,), jnp.int32), 1.0)
