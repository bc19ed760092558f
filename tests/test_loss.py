"""Paper rules for the loss (eq. 9, eq. 17, A.4), checked against numbers computed by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actionopd_jax.train import losses as L


def _loss_and_grad(fn, logp_new, *args, **kw):
    def f(x):
        return L.mean_loss(fn(x, *args, **kw))

    return jax.value_and_grad(f)(jnp.asarray(logp_new, jnp.float32))


def test_positive_advantage_ppo_clip_and_masked_token():
    # A = +1, ratios [1, 1.5, 0.5, 1.1], last token masked (prompt/padding).
    ratios = np.array([[1.0, 1.5, 0.5, 1.1]])
    old = np.array([[-1.0, -2.0, -0.5, -3.0]])
    new = old + np.log(ratios)
    mask = np.array([[1.0, 1.0, 1.0, 0.0]])
    loss, grad = _loss_and_grad(L.actionopd_sums, new, old, np.array([1.0]), mask)
    # h = [1, min(1.5, 1.2)=1.2, min(0.5, 0.8)=0.5]; loss = -(2.7)/3
    assert float(loss) == pytest.approx(-0.9, abs=1e-6)
    # d(-h/3)/dlogp: unclipped tokens give -rho*A/3; the clipped one and the masked one 0
    np.testing.assert_allclose(np.asarray(grad), [[-1 / 3, 0.0, -0.5 / 3, 0.0]], atol=1e-6)
    s = L.actionopd_sums(jnp.asarray(new), old, jnp.array([1.0]), mask)
    assert float(s.tokens) == 3 and float(s.clipped_high) == 1 and float(s.clipped_low) == 0


def test_negative_advantage_dual_clip():
    # A = -2, ratios [1, 1.5, 0.5, 4]: plain, unclipped-pessimistic, PPO-clipped, dual-clipped.
    ratios = np.array([[1.0, 1.5, 0.5, 4.0]])
    old = np.zeros((1, 4))
    new = np.log(ratios)
    mask = np.ones((1, 4))
    loss, grad = _loss_and_grad(L.actionopd_sums, new, old, np.array([-2.0]), mask)
    # h = [-2, min(-3, -2.4) = -3, min(-1, -1.6) = -1.6, max(min(-8, -2.4), -6) = -6]
    assert float(loss) == pytest.approx(12.6 / 4, abs=1e-6)
    np.testing.assert_allclose(np.asarray(grad), [[0.5, 0.75, 0.0, 0.0]], atol=1e-6)
    s = L.actionopd_sums(jnp.asarray(new), old, jnp.array([-2.0]), mask)
    assert (float(s.clipped_low), float(s.dual_clipped), float(s.clipped_high)) == (1, 1, 0)


def test_dual_clip_objective_elementwise():
    rho = jnp.array([0.5, 1.0, 1.3, 10.0, 10.0])
    adv = jnp.array([1.0, 0.0, 1.0, 1.0, -1.0])
    got = L.dual_clip_objective(rho, adv, 0.2, 3.0)
    # A>0 with rho=10: min(10, 1.2) = 1.2 (no dual clip for positive advantages)
    np.testing.assert_allclose(np.asarray(got), [0.5, 0.0, 1.2, 1.2, -3.0], atol=1e-6)
    with pytest.raises(ValueError, match="dual_clip"):
        L.dual_clip_objective(rho, adv, 0.2, 1.0)


def test_token_mean_over_whole_batch_not_mean_of_rows():
    # rows with 1 and 3 active tokens, rho = 1: loss = -(A0*1 + A1*3) / 4, not the row mean.
    old = np.zeros((2, 3))
    mask = np.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = np.array([1.0, -1.0])
    loss, _ = _loss_and_grad(L.actionopd_sums, old, old, adv, mask)
    assert float(loss) == pytest.approx(-(1.0 - 3.0) / 4, abs=1e-6)


def test_garbage_logprobs_at_masked_positions_do_not_leak():
    old = np.array([[-1.0, 0.0]])
    new = jnp.array([[-1.0, jnp.inf]])
    mask = np.array([[1.0, 0.0]])
    loss, grad = _loss_and_grad(L.actionopd_sums, new, old, np.array([1.0]), mask)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
    assert float(loss) == pytest.approx(-1.0)


def test_accumulation_over_unequal_microbatches_equals_one_batch():
    rng = np.random.default_rng(3)
    old = rng.normal(size=(5, 6)) - 2
    new = old + 0.4 * rng.normal(size=(5, 6))
    adv = rng.normal(size=5)
    mask = (rng.random((5, 6)) < 0.6).astype(np.float32)
    mask[:, 0] = 1

    full, full_grad = _loss_and_grad(L.actionopd_sums, new, old, adv, mask)

    def summed(x):
        parts = [slice(0, 1), slice(1, 4), slice(4, 5)]  # 1, 3 and 1 rows: unequal sizes
        tot = L.zero_sums()
        for p in parts:
            tot = L.add_sums(tot, L.actionopd_sums(x[p], old[p], adv[p], mask[p]))
        return L.mean_loss(tot)

    acc, acc_grad = jax.value_and_grad(summed)(jnp.asarray(new, jnp.float32))
    assert float(acc) == pytest.approx(float(full), rel=1e-6)
    np.testing.assert_allclose(np.asarray(acc_grad), np.asarray(full_grad), rtol=1e-5, atol=1e-7)
    # a mean of microbatch means would differ here (the parts have unequal token counts)
    mom = np.mean([
        float(L.mean_loss(L.actionopd_sums(jnp.asarray(new[p]), old[p], adv[p], mask[p])))
        for p in [slice(0, 1), slice(1, 4), slice(4, 5)]
    ])
    assert abs(mom - float(full)) > 1e-3


def test_token_logprobs_full_softmax_at_temperature():
    logits = jnp.array([[0.0, math.log(3.0), -1e9]])
    # T = 0.5: scaled logits [0, 2 ln 3] -> p = [1/10, 9/10] (third entry ~0)
    got = L.token_logprobs(logits, jnp.array([1]), temperature=0.5)
    assert float(got[0]) == pytest.approx(math.log(0.9), abs=1e-6)
    got1 = L.token_logprobs(logits, jnp.array([0]), temperature=1.0)
    assert float(got1[0]) == pytest.approx(math.log(1 / 4), abs=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        L.token_logprobs(logits, jnp.array([0]), temperature=0.0)


def test_kd_cross_entropy_on_teacher_tokens():
    logp = np.array([[-1.0, -2.0, -7.0]])
    mask = np.array([[1.0, 1.0, 0.0]])
    loss, grad = _loss_and_grad(L.kd_sums, logp, mask)
    assert float(loss) == pytest.approx(1.5)
    np.testing.assert_allclose(np.asarray(grad), [[-0.5, -0.5, 0.0]])


def test_opd_sampled_token_reverse_kl():
    old = np.array([[-1.0, -2.0, -1.0]])
    teacher = np.array([[-0.5, -3.0, np.nan]])  # padded teacher logp may be garbage
    mask = np.array([[1.0, 1.0, 0.0]])
    loss, grad = _loss_and_grad(L.opd_sums, old, old, teacher, mask)
    # token advantages = teacher - old = [0.5, -1]; rho = 1 -> loss = -(0.5 - 1) / 2
    assert float(loss) == pytest.approx(0.25)
    # gradient = (log pi_old - log pi_T) / tokens: the reverse-KL score-function gradient
    np.testing.assert_allclose(np.asarray(grad), [[-0.25, 0.5, 0.0]], atol=1e-6)


def test_logprob_mismatch_stats():
    trainer = np.array([[-1.0, -2.0, -3.0]])
    sampler = np.array([[-1.5, -2.0, 9.0]])
    m = L.logprob_mismatch(jnp.asarray(trainer), jnp.asarray(sampler), jnp.array([[1.0, 1.0, 0.0]]))
    assert float(m["abs_diff_sum"]) == pytest.approx(0.5)
    assert float(m["kl_sum"]) == pytest.approx(-0.5)
    assert float(m["abs_diff_max"]) == pytest.approx(0.5)
    assert float(m["tokens"]) == 2
