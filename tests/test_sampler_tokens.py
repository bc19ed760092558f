"""Token choice from fixed logits: the sampled distribution is the intended one.

Each case draws many rows (each row has its own key) from the same logits and compares the
empirical frequencies with the distribution computed here by an explicit sort in numpy.
"""

import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actionopd_jax.sampling.token_choice import choose_tokens

DRAWS = 20_000
CAP = 8  # small cap so that both the candidate path and the full-vocabulary path run


def reference_distribution(logits, temperature, top_k, top_p):
    """top-k, then top-p on the top-k-renormalised distribution, at temperature T."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1.0
        return out
    p = np.exp(logits / temperature - np.max(logits / temperature))
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    k = len(p) if top_k <= 0 else min(top_k, len(p))
    kept = order[:k]
    pk = p[kept] / p[kept].sum()
    above = np.cumsum(pk) - pk
    kept = kept[(above < top_p) | (np.arange(len(kept)) == 0)]
    out = np.zeros_like(p)
    out[kept] = p[kept] / p[kept].sum()
    return out


_jitted = jax.jit(choose_tokens, static_argnames=("cap",))


def draw(logits, temperature, top_k, top_p, seed, n=DRAWS):
    logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    keys = jax.random.split(jax.random.key(seed), n)
    tokens, logprobs = _jitted(logits, keys, jnp.full((n,), temperature, jnp.float32),
                               jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p, jnp.float32),
                               cap=CAP)
    return np.asarray(tokens), np.asarray(logprobs)


def total_variation(tokens, expected):
    freq = np.bincount(tokens, minlength=len(expected)) / len(tokens)
    return 0.5 * np.abs(freq - expected).sum(), freq


RNG = np.random.default_rng(7)
PEAKED = RNG.normal(size=40) * 3.0   # most mass on a few tokens: nucleus fits in CAP
FLAT = RNG.normal(size=40) * 0.3     # mass spread: nucleus wider than CAP -> full sort path

CASES = [
    # (name, logits, T, top_k, top_p)
    ("topk-in-cap", PEAKED, 0.7, 5, 1.0),
    ("topk-then-topp", PEAKED, 1.0, 6, 0.7),
    ("topp-fits-cap", PEAKED, 1.3, 0, 0.8),
    ("topp-wider-than-cap", FLAT, 1.0, 0, 0.9),
    ("topk-above-cap", FLAT, 0.8, 20, 1.0),
    ("topk-above-cap-and-topp", FLAT, 1.0, 25, 0.6),
    ("pure-temperature", FLAT, 0.5, 0, 1.0),
    ("hot", PEAKED, 2.0, 0, 1.0),
]


@pytest.mark.parametrize("name,logits,temperature,top_k,top_p", CASES, ids=[c[0] for c in CASES])
def test_empirical_distribution_matches(name, logits, temperature, top_k, top_p):
    expected = reference_distribution(logits, temperature, top_k, top_p)
    tokens, logprobs = draw(logits, temperature, top_k, top_p, seed=zlib.crc32(name.encode()))
    tv, freq = total_variation(tokens, expected)
    assert tv < 0.03, (name, tv)
    # excluded tokens are never drawn, not just rarely
    assert freq[expected == 0].sum() == 0.0
    # logprobs: full (untruncated) softmax at temperature T, at the sampled token
    full = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32) / temperature)
    np.testing.assert_allclose(logprobs, np.asarray(full)[tokens], rtol=1e-5, atol=1e-5)


def test_hand_computed_nucleus():
    """p = [0.5, 0.3, 0.15, 0.05].
    top_p 0.8: mass above each rank is 0, 0.5, 0.8, 0.95 -> keep ranks 0, 1 -> 0.625 / 0.375.
    top_k 3, top_p 0.9: top-3 mass 0.95, renormalised above = 0, 0.526, 0.842 < 0.9 -> keep 3:
    0.5/0.95, 0.3/0.95, 0.15/0.95 = 0.526, 0.316, 0.158.
    top_k 2, top_p 0.6: top-2 renormalised = 0.625, 0.375; above = 0, 0.625 -> only rank 0
    (without the renormalisation, 0.5 < 0.6 would wrongly keep rank 1)."""
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    tokens, _ = draw(logits, 1.0, 0, 0.8, seed=1)
    freq = np.bincount(tokens, minlength=4) / len(tokens)
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.015)
    tokens, _ = draw(logits, 1.0, 3, 0.9, seed=2)
    freq = np.bincount(tokens, minlength=4) / len(tokens)
    np.testing.assert_allclose(freq, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=0.015)
    assert set(draw(logits, 1.0, 2, 0.6, seed=5, n=2000)[0]) == {0}
    # top_k 1 and temperature 0 are both argmax
    assert set(draw(logits, 1.0, 1, 1.0, seed=3, n=500)[0]) == {0}
    tokens, logprobs = draw(logits, 0.0, 0, 1.0, seed=4, n=500)
    assert set(tokens) == {0}
    np.testing.assert_allclose(logprobs, np.log(0.5), rtol=1e-5)  # greedy reports T=1


def test_rows_with_different_settings_in_one_batch():
    """Per-row settings: each row follows its own rule although they share the call."""
    settings = [(0.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.9), (0.5, 0, 1.0)]
    per = 5_000
    rows = [s for s in settings for _ in range(per)]
    n = len(rows)
    logits = jnp.broadcast_to(jnp.asarray(FLAT, jnp.float32), (n, len(FLAT)))
    keys = jax.random.split(jax.random.key(11), n)
    t, k, p = (jnp.asarray(x) for x in zip(*rows))
    tokens, _ = _jitted(logits, keys, t.astype(jnp.float32), k.astype(jnp.int32), p.astype(jnp.float32), cap=CAP)
    tokens = np.asarray(tokens)
    for i, (temperature, top_k, top_p) in enumerate(settings):
        tv, _ = total_variation(tokens[i * per:(i + 1) * per], reference_distribution(FLAT, temperature, top_k, top_p))
        assert tv < 0.05, (settings[i], tv)


def test_changing_settings_does_not_recompile():
    traces = []

    def counted(*args):
        traces.append(1)
        return choose_tokens(*args, cap=CAP)

    f = jax.jit(counted)
    n = 16
    logits = jnp.broadcast_to(jnp.asarray(FLAT, jnp.float32), (n, len(FLAT)))
    for i, (temperature, top_k, top_p) in enumerate(itertools.product([0.0, 0.6, 1.5], [0, 3, 30], [0.5, 1.0])):
        keys = jax.random.split(jax.random.key(i), n)
        f(logits, keys, jnp.full((n,), temperature), jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p))
    assert len(traces) == 1


def test_same_key_same_draw_and_row_independence():
    logits = jnp.broadcast_to(jnp.asarray(FLAT, jnp.float32), (64, len(FLAT)))
    args = (jnp.full((64,), 1.0), jnp.zeros((64,), jnp.int32), jnp.full((64,), 1.0))
    keys = jax.random.split(jax.random.key(5), 64)
    a, _ = _jitted(logits, keys, *args, cap=CAP)
    b, _ = _jitted(logits, keys, *args, cap=CAP)
    c, _ = _jitted(logits, jax.random.split(jax.random.key(6), 64), *args, cap=CAP)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    # a row's draw depends only on its own key: the first 8 rows alone give the same tokens
    d, _ = _jitted(logits[:8], keys[:8], *(x[:8] for x in args), cap=CAP)
    assert np.array_equal(np.asarray(a)[:8], np.asarray(d))


@pytest.mark.parametrize("vocab_major", [False, True])
@pytest.mark.parametrize("vocab,cap", [(1037, 8), (4096, 64), (20_011, 64)])
@pytest.mark.parametrize("kind", ["normal", "ties-at-top", "few-values", "half-masked"])
def test_candidate_search_equals_lax_top_k(vocab, cap, kind, vocab_major):
    """The grouped candidate search returns exactly lax.top_k's values and ids, ties to the
    lower id included (equal logits force its exact fallback), from logits laid out [rows, V]
    or [V, rows] (the checked head's layout). 1037 = 17 x 61 and 4096 split into groups
    without a remainder; 20,011 is prime, so its last ids are a tail outside the groups."""
    from actionopd_jax.sampling.token_choice import _top_candidates

    rng = np.random.default_rng(vocab + cap)
    x = rng.normal(size=(6, vocab)).astype(np.float32)
    if kind == "ties-at-top":
        x[:, ::7] = x.max() + 1.0      # many equal maxima spread over the groups
    elif kind == "few-values":
        x = rng.integers(0, 5, size=(6, vocab)).astype(np.float32)
    elif kind == "half-masked":
        x[:, : vocab // 2] = -np.inf
    search = jax.jit(lambda logits: _top_candidates(logits, cap, vocab_major=vocab_major))
    values, ids = search(jnp.asarray(x.T.copy() if vocab_major else x))
    ref_values, ref_ids = jax.lax.top_k(jnp.asarray(x), cap)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(ref_values))
