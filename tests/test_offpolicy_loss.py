"""The stale-group correction of the ActionOPD surrogate (issue 44): decoupled ratio, truncated weight.

A group sampled by a policy up to eta updates older carries the log-probs recorded at sampling
time (`logp_behav`). The clip and the dual clip stay centred on the proximal policy (the
trainer's recomputation with the weights being updated: today's `logp_old`), and each token's
h_dual is weighted by min(pi_prox / pi_behav, cap). A fresh group (logp_behav = logp_old) gets
today's loss bit for bit. The miniature at the end is the test that chose this correction.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actionopd_jax.train import losses as L


def _hand_case():
    # three tokens: A=+1 at ratio 1.5 (PPO clip: 1.2), A=-1 at ratio 0.5 (clip: -0.8),
    # A=-1 at ratio 4 (dual clip: max(-4, -3) = -3)
    old = jnp.log(jnp.array([[0.2, 0.4, 0.1]], jnp.float32))
    new = old + jnp.log(jnp.array([[1.5, 0.5, 4.0]], jnp.float32))
    adv = jnp.array([[1.0, -1.0, -1.0]], jnp.float32)
    return new, old, adv, jnp.ones((1, 3), jnp.float32)


def test_fresh_group_is_todays_loss_bit_for_bit():
    new, old, adv, mask = _hand_case()
    today = L.actionopd_sums(new, old, adv, mask)
    fresh = L.actionopd_sums(new, old, adv, mask, logp_behav=old)
    assert float(today.loss_sum) == pytest.approx(-(1.2 - 0.8 - 3.0), abs=1e-6)
    for a, b in zip(today, fresh):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # and so are the gradients, on random rows with padding
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    new = jax.random.normal(k[0], (4, 6)) - 2.0
    old = new + 0.3 * jax.random.normal(k[1], (4, 6))
    adv = jax.random.normal(k[2], (4,))
    mask = jnp.ones((4, 6)).at[:, 4:].set(0.0)
    g = lambda **kw: jax.grad(lambda x: L.actionopd_sums(x, old, adv, mask, **kw).loss_sum)(new)  # noqa: E731
    assert np.array_equal(np.asarray(g()), np.asarray(g(logp_behav=old)))


def test_stale_tokens_weighted_by_truncated_ratio_with_dual_clip_kept():
    new, old, adv, mask = _hand_case()
    # the sampling policy gave these tokens 1/1.5, 2x and 1/4 of the proximal probability:
    # weights 1.5, 0.5 and 4 truncated to the cap 2
    behav = old - jnp.log(jnp.array([[1.5, 0.5, 4.0]], jnp.float32))
    s = L.actionopd_sums(new, old, adv, mask, logp_behav=behav, weight_cap=2.0)
    assert float(s.loss_sum) == pytest.approx(-(1.5 * 1.2 + 0.5 * -0.8 + 2.0 * -3.0), rel=1e-6)
    # the clip statistics are about the ratio to the proximal policy, not the weights
    assert (float(s.clipped_high), float(s.clipped_low), float(s.dual_clipped)) == (1.0, 1.0, 1.0)
    assert float(s.ratio_sum) == pytest.approx(1.5 + 0.5 + 4.0, rel=1e-6)
    # the weight is a constant: at the proximal policy itself (rho = 1, nothing clipped) the
    # gradient is each token's weight times today's
    g_today = jax.grad(lambda x: L.actionopd_sums(x, old, adv, mask).loss_sum)(old)
    g_stale = jax.grad(lambda x: L.actionopd_sums(x, old, adv, mask, logp_behav=behav).loss_sum)(old)
    np.testing.assert_allclose(np.asarray(g_stale), np.asarray(g_today) * np.array([[1.5, 0.5, 2.0]]),
                               rtol=1e-6)


def test_weight_cap_below_one_and_garbage_padding():
    new, old, adv, mask = _hand_case()
    with pytest.raises(ValueError, match="weight_cap must be >= 1"):
        L.actionopd_sums(new, old, adv, mask, logp_behav=old, weight_cap=0.5)
    behav = old.at[0, 2].set(-jnp.inf)           # a padded position's recorded value
    s = L.actionopd_sums(new, old, adv, mask.at[0, 2].set(0.0), logp_behav=behav)
    assert math.isfinite(float(s.loss_sum))


def _miniature(drift: float, reps: int = 1000, batch: int = 32, actions: int = 16) -> dict:
    """One-token episodes over `actions` actions. The behaviour policy is the current one
    `drift` (per-logit sd) ago; the candidates are drawn from it, the advantage is centred
    under the current policy. Returns (bias, mse) of each surrogate's first gradient against
    the current policy's exact gradient, over `reps` batches (the same draws for all)."""
    rng = np.random.default_rng(0)
    theta_b = jnp.asarray(rng.normal(0, 1, actions), jnp.float32)
    reward = jnp.asarray(rng.normal(0, 1, actions), jnp.float32)
    theta_v = theta_b + jnp.asarray(np.random.default_rng(1).normal(0, drift, actions), jnp.float32)
    adv_of = reward - jnp.sum(jax.nn.softmax(theta_v) * reward)
    exact = jax.grad(lambda th: jnp.sum(jax.nn.softmax(th) * adv_of))(theta_v)
    draws = jax.random.categorical(jax.random.PRNGKey(2), theta_b, shape=(reps, batch))
    cap = 2.0

    def grads(a):
        lb, lv = jax.nn.log_softmax(theta_b)[a], jax.nn.log_softmax(theta_v)[a]
        adv, mask = adv_of[a], jnp.ones(a.shape, jnp.float32)
        kept = mask * (jnp.exp(lv - lb) <= cap)     # AReaL's cap: drop the token above it
        losses = {
            "ignore": lambda ln: L.actionopd_sums(ln, lv, adv, mask),         # stale as if fresh
            "behaviour": lambda ln: L.actionopd_sums(ln, lb, adv, mask),      # clip at the sampler
            "masked": lambda ln: L.actionopd_sums(ln, lv, adv, kept, logp_behav=lb, weight_cap=1e9),
            "truncated": lambda ln: L.actionopd_sums(ln, lv, adv, mask, logp_behav=lb, weight_cap=cap),
        }
        return {k: -jax.grad(lambda th: f(jax.nn.log_softmax(th)[a]).loss_sum / batch)(theta_v)
                for k, f in losses.items()}

    g = jax.jit(jax.vmap(grads))(draws)
    return {k: (float(jnp.linalg.norm(v.mean(0) - exact)), float(jnp.mean(jnp.sum((v - exact) ** 2, -1))))
            for k, v in g.items()}


def test_miniature_chooses_the_decoupled_truncated_correction():
    """Why the correction is the decoupled ratio with a truncated weight: ignoring staleness
    is biased at any drift; PPO clipped around the stale sampler (logp_old = logp_behav) is
    biased once the drift leaves the trust region (tokens clipped for the wrong reason);
    AReaL's drop-above-cap loses the tokens the current policy now likes most (biased) and
    truncation at the same cap keeps them at weight 2: the least bias and the least error."""
    r = _miniature(drift=2.5)
    bias = {k: b for k, (b, _) in r.items()}
    mse = {k: m for k, (_, m) in r.items()}
    assert bias["truncated"] < 0.5 * min(bias["masked"], bias["behaviour"], bias["ignore"])
    assert mse["truncated"] < min(mse["masked"], mse["behaviour"], mse["ignore"])
