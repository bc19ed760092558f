"""The "checked" LM head (sampling/checked_head.py): a bfloat16 head whose candidates are
recomputed in float32 must pick exactly the float32 head's tokens, report logprobs within
1e-5 of float32, and fall back to the float32 head whenever its error bound cannot settle a row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actionopd_jax.sampling import Buckets, Sampler
from actionopd_jax.sampling.checked_head import checked_head, choose_tokens_checked, error_bound
from actionopd_jax.sampling.token_choice import choose_tokens
from tests._sampler_fixtures import random_model

CAP, SEARCH = 16, 32


def _exact(h, w):
    return jnp.einsum("bd,vd->bv", h, w, preferred_element_type=jnp.float32)


@jax.jit
def _bound_and_error(h, w):
    head = checked_head(w)
    h16 = h.astype(jnp.bfloat16)
    approx = jnp.einsum("bd,vd->bv", h16, head.w16, preferred_element_type=jnp.float32)
    return error_bound(head, h, h16), approx


def test_error_bound_holds_for_random_and_adversarial_heads():
    """|float32 logit - bf16 logit| <= delta for every row and id, measured against a float64
    reference and against float32 itself, for random heads at several scales and for an
    adversarial one: every product h_i W_vi has the same sign and each value sits just below
    a bf16 rounding midpoint, so rounding errors add up instead of cancelling."""
    rng = np.random.default_rng(0)
    cases = []
    for scale in (1e-3, 0.02, 1.0, 30.0):
        cases.append((rng.normal(0, 1, (16, 96)).astype(np.float32) * 4,
                      rng.normal(0, scale, (512, 96)).astype(np.float32)))
    # adversarial: |x| = 1 + 2^-8 - 2^-12 (rounds down by almost half a bf16 step), signs aligned
    mag = np.float32(1 + 2.0 ** -8 - 2.0 ** -12)
    signs = np.sign(rng.normal(size=(1, 96))).astype(np.float32)
    h = np.repeat(signs * mag, 4, axis=0) * np.array([[1.0], [3.0], [0.01], [100.0]], np.float32)
    w = np.repeat(signs * mag * 0.05, 64, axis=0) * rng.uniform(0.5, 2.0, (64, 1)).astype(np.float32)
    cases.append((h, w))
    for h, w in cases:
        delta, approx = map(np.asarray, _bound_and_error(jnp.asarray(h), jnp.asarray(w)))
        ref64 = h.astype(np.float64) @ w.astype(np.float64).T
        ref32 = np.asarray(_exact(jnp.asarray(h), jnp.asarray(w)))
        for ref in (ref64, ref32):
            err = np.abs(ref - approx).max(-1)
            assert (err <= delta).all(), (err / delta).max()
    # the adversarial case really is adversarial: the error uses a good part of the bound
    assert (err / delta).max() > 0.3


def _settings(rows):
    """Per-row (temperature, top_k, top_p) cycling through greedy and top-k <= CAP rows."""
    table = [(0.0, 0, 1.0), (0.6, 8, 0.95), (1.3, 5, 1.0), (0.9, CAP, 0.8)]
    t, k, p = zip(*[table[r % len(table)] for r in range(rows)])
    return jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32)


_checked = jax.jit(lambda h, w, keys, t, k, p, active: choose_tokens_checked(
    checked_head(w), w, h, lambda x: _exact(x, w), keys, t, k, p, cap=CAP, search=SEARCH, active=active))
_float32 = jax.jit(lambda logits, keys, t, k, p, active: choose_tokens(logits, keys, t, k, p, cap=CAP,
                                                                       active=active))


LOGP_TOL = 3e-3  # the normaliser uses bf16 logits outside the searched ids (checked_head.py)


def _compare(h, w, t, k, p, seed, active=None):
    keys = jax.random.split(jax.random.key(seed), h.shape[0])
    active = jnp.ones(h.shape[0], bool) if active is None else active
    tok, logp, fell_back = _checked(h, w, keys, t, k, p, active)
    ref_tok, ref_logp = _float32(_exact(h, w), keys, t, k, p, active)
    live = np.asarray(active)
    np.testing.assert_array_equal(np.asarray(tok)[live], np.asarray(ref_tok)[live])
    err = np.abs(np.asarray(logp) - np.asarray(ref_logp))[live].max()
    print("max |logprob - float32 logprob|", err)
    assert err <= LOGP_TOL
    return bool(fell_back)


def test_checked_choice_is_the_float32_choice():
    """Greedy and top-k rows at several temperatures over a 4096-token vocabulary: the same
    tokens as choose_tokens on the float32 logits (same keys), logprobs within 1e-5, and no
    float32 fallback was needed (the bf16 ranking settled every row)."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(0, 0.3, (4096, 64)), jnp.float32)
    fell = []
    for seed in range(6):
        h = jnp.asarray(rng.normal(0, 1, (32, 64)), jnp.float32)
        fell.append(_compare(h, w, *_settings(32), seed))
    assert not any(fell)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (0, 1.0), (CAP + 1, 1.0)])
def test_rows_outside_the_candidates_take_the_float32_path(top_k, top_p):
    """Top-k off (pure top-p, pure temperature) or above `cap`: the kept set may extend past
    the candidates, so the row must come from the float32 head; inactive rows never force it."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.normal(0, 0.3, (4096, 64)), jnp.float32)
    h = jnp.asarray(rng.normal(0, 1, (8, 64)), jnp.float32)
    t, k, p = _settings(8)
    k, p = k.at[3].set(top_k), p.at[3].set(top_p)
    assert _compare(h, w, t, k, p, seed=3)
    assert not _compare(h, w, t, k, p, seed=3, active=jnp.arange(8) != 3)


def test_near_ties_below_bf16_resolution_fall_back():
    """Forty ids whose logits differ by less than bf16 can resolve: the bf16 ranking cannot
    tell which are the top 8, the check must refuse, and the float32 path must pick."""
    rng = np.random.default_rng(4)
    w = rng.normal(0, 0.3, (1024, 64)).astype(np.float32)
    h = rng.normal(0, 1, (4, 64)).astype(np.float32)
    direction = h[0] / np.linalg.norm(h[0]) ** 2
    w[:40] = 12.0 * direction + 1e-5 * rng.normal(size=(40, 1)).astype(np.float32) * direction
    t = jnp.full((4,), 0.7, jnp.float32)
    k = jnp.full((4,), 8, jnp.int32)
    p = jnp.ones((4,), jnp.float32)
    assert _compare(jnp.asarray(h), jnp.asarray(w), t, k, p, seed=5)


def test_sampler_default_head_matches_float32_sampler():
    """End to end on a random Qwen3 with an 8192-token vocabulary (so the grouped candidate
    search runs): the default Sampler ("checked") and Sampler(lm_head="float32") give the same
    tokens for the same keys, logprobs within 1e-5, and the fallback count is reported."""
    model = random_model(5, vocab_size=8192)
    buckets = Buckets(prompt_len=(32,), prompts=(2,), samples=(4,), max_new=(16,))
    prompts = [np.arange(3, 20, dtype=np.int32), np.arange(100, 130, dtype=np.int32)]
    outs = {}
    for head in ("checked", "float32"):
        s = Sampler(model, eos_ids=[], buckets=buckets, lm_head=head)
        outs[head] = [s.sample(prompts, n=4, max_new_tokens=16, temperature=t, top_k=k, top_p=0.95,
                               key=jax.random.key(9)) for t, k in ((0.6, 20), (0.0, 0))]
    for checked, exact in zip(outs["checked"], outs["float32"]):
        assert exact.head_fallback_steps == 0
        assert checked.head_fallback_steps <= 2  # of 15 decode steps: the bound settles nearly all
        for gc, ge in zip(checked.generations, exact.generations):
            for a, b in zip(gc, ge):
                np.testing.assert_array_equal(a.token_ids, b.token_ids)
                err = np.abs(a.logprobs - b.logprobs).max()
                print("sampler max |logprob - float32 logprob|", err)
                assert err <= LOGP_TOL


def test_sampler_rebuilds_the_bf16_head_when_the_weights_change():
    """The Sampler keeps the bf16 copy of the head between calls while the head-weight array
    is unchanged, and rebuilds it after a parameter update: sampling after the update must
    follow the new weights (same tokens as a float32 sampler on the updated model)."""
    model = random_model(6, vocab_size=2048)
    buckets = Buckets(prompt_len=(16,), prompts=(1,), samples=(2,), max_new=(8,))
    prompts = [np.arange(5, 17, dtype=np.int32)]
    checked = Sampler(model, eos_ids=[], buckets=buckets)
    exact = Sampler(model, eos_ids=[], buckets=buckets, lm_head="float32")
    kw = dict(n=2, max_new_tokens=8, temperature=0.8, top_k=10, key=jax.random.key(2))
    before = checked.sample(prompts, **kw)
    kept = checked._checked[1]
    checked.sample(prompts, **kw)
    assert checked._checked[1] is kept
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    head[...] = head[...][::-1] * 1.5  # a parameter update: a new head-weight array
    after = checked.sample(prompts, **kw)
    assert checked._checked[1] is not kept
    ref = exact.sample(prompts, **kw)
    for g, r in zip(after.generations[0], ref.generations[0]):
        np.testing.assert_array_equal(g.token_ids, r.token_ids)
    assert any(not np.array_equal(a.token_ids, b.token_ids)
               for a, b in zip(before.generations[0], after.generations[0]))


@pytest.mark.parametrize("vocab", [4096, 20_011])
def test_vocab_major_exp_sum_is_the_plain_sum(vocab):
    """The normaliser's blocked exp-sum over [V, B] logits (a divisor of V, or a prime V with
    a tail) equals sum_v exp((x - shift) / T) per column to float32 summation accuracy."""
    from actionopd_jax.sampling.checked_head import _exp_sum_vocab_major

    rng = np.random.default_rng(vocab)
    x = rng.normal(size=(vocab, 5)).astype(np.float32) * 3
    shift = x.max(0)
    temp = np.array([0.3, 0.6, 1.0, 1.7, 1.0], np.float32)
    got = np.asarray(jax.jit(_exp_sum_vocab_major)(jnp.asarray(x), jnp.asarray(shift), jnp.asarray(temp)))
    want = np.exp((x.astype(np.float64) - shift) / temp).sum(0)
    np.testing.assert_allclose(got, want, rtol=2e-6)
