"""Choosing the next token from a batch of logits: greedy, temperature, top-k, top-p.

Everything that varies between calls (temperature, top-k, top-p, per-row PRNG keys) is a
traced array, so one compiled program serves every sampling setting. Only `cap`, the number
of candidates kept by `lax.top_k`, is static.

Rules (the same as HF transformers and vLLM):
- temperature 0 means greedy (argmax of the logits);
- top-k keeps the k most likely tokens (k = 0: no top-k);
- top-p is applied after top-k, on the distribution renormalised over the top-k tokens: sort
  by probability, keep the shortest prefix whose cumulative probability reaches top_p (a
  token is kept when the probability of the tokens ranked strictly above it is < top_p);
- the returned log-probability is log_softmax(logits / T) at the chosen token, over the FULL
  vocabulary (never the truncated distribution): the ActionOPD ratio needs the behaviour
  policy's full tempered softmax. Greedy rows report it at T = 1.

Why candidates: sorting the 151k-token vocabulary at every decode step costs ~1 s per step on
a CPU (transformers spends most of its decode time there). `lax.top_k(logits, cap)` costs a
few ms and is exact whenever the kept set lies inside the top `cap` tokens: always for
1 <= top_k <= cap, and for top_k = 0 whenever the top-`cap` probability mass reaches top_p.
Rows outside that (top_k > cap, pure temperature sampling, or a nucleus wider than `cap`)
take an exact full-vocabulary path, run only when some row needs it (`lax.cond`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_CAP = 64


def _gumbel_rows(keys: jax.Array, width: int) -> jax.Array:
    """Independent Gumbel noise per row from that row's own key: a row's draw does not
    depend on which other rows share the batch."""
    return jax.vmap(lambda k: jax.random.gumbel(k, (width,), jnp.float32))(keys)


def _nucleus_keep(probs_desc: jax.Array, k_eff: jax.Array, top_p: jax.Array,
                  mass_k: jax.Array | None = None) -> jax.Array:
    """Which ranks survive top-k then top-p. probs_desc: [B, W] full-softmax probabilities
    sorted descending (W = cap, or V for the full path); k_eff: [B] (V = no top-k);
    mass_k: [B] probability of the top-k set (default: the in-k part of probs_desc)."""
    rank = jnp.arange(probs_desc.shape[-1])[None, :]
    in_k = rank < k_eff[:, None]
    kept_probs = jnp.where(in_k, probs_desc, 0.0)
    if mass_k is None:
        mass_k = kept_probs.sum(-1)
    above = jnp.cumsum(kept_probs, axis=-1) - kept_probs  # mass ranked strictly above
    return in_k & ((above < top_p[:, None] * mass_k[:, None]) | (rank == 0))


def _sample_sorted(vals_desc, idx_desc, keep, keys, greedy):
    """Gumbel-max over the kept entries of a descending list; greedy rows take rank 0."""
    noise = _gumbel_rows(keys, vals_desc.shape[-1])
    choice = jnp.argmax(jnp.where(keep, vals_desc + noise, -jnp.inf), axis=-1)
    choice = jnp.where(greedy, 0, choice)
    return jnp.take_along_axis(idx_desc, choice[:, None], axis=-1)[:, 0]


def _full_vocab_choice(scaled, lse, keys, k_eff, top_p, greedy):
    """Exact path over the whole vocabulary. A full sort only when some row truncates
    (top-k > cap or a wide nucleus); pure temperature rows need just Gumbel-max."""
    vocab = scaled.shape[-1]
    truncating = (k_eff < vocab) | (top_p < 1.0)

    def by_sort(_):
        order = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), scaled.shape)
        neg_sorted, idx = jax.lax.sort_key_val(-scaled, order, dimension=-1)
        vals = -neg_sorted
        keep = _nucleus_keep(jnp.exp(vals - lse[:, None]), k_eff, top_p)
        return _sample_sorted(vals, idx, keep, keys, greedy)

    def by_gumbel(_):
        noise = _gumbel_rows(keys, vocab)
        return jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)

    return jax.lax.cond(jnp.any(truncating & ~greedy), by_sort, by_gumbel, None)


def choose_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, *, cap: int = DEFAULT_CAP,
                  active: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row.

    logits f32[B, V]; keys: [B] typed PRNG keys (one per row, already folded with the step);
    temperature f32[B] (0 = greedy); top_k i32[B] (0 = off); top_p f32[B] in (0, 1];
    active bool[B] (rows that still need a token: finished rows never force the slow path).
    Returns (tokens i32[B], logprobs f32[B]).
    """
    vocab = logits.shape[-1]
    cap = min(cap, vocab)
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0.0
    temp = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    scaled = logits / temp[:, None]
    lse = jax.nn.logsumexp(scaled, axis=-1)

    k_eff = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).astype(jnp.int32)
    cand_vals, cand_idx = jax.lax.top_k(scaled, cap)
    cand_probs = jnp.exp(cand_vals - lse[:, None])
    # candidate path is exact iff the kept set provably lies in the top `cap` tokens
    nucleus_fits = (k_eff == vocab) & (top_p < 1.0) & (cand_probs.sum(-1) >= top_p)
    exact_in_cap = greedy | (k_eff <= cap) | nucleus_fits
    # top-p renormalises over the top-k set: its mass is known from the candidates when
    # k <= cap, and is the whole distribution (1) when there is no top-k. Rows with
    # cap < k < V get a placeholder here; their candidate result is discarded below.
    in_cap_k = jnp.minimum(k_eff, cap)
    cand_mass_k = jnp.where(k_eff == vocab, 1.0,
                            jnp.where(jnp.arange(cap)[None, :] < in_cap_k[:, None], cand_probs, 0.0).sum(-1))
    keep = _nucleus_keep(cand_probs, in_cap_k, top_p, cand_mass_k)
    cand_tokens = _sample_sorted(cand_vals, cand_idx, keep, keys, greedy)

    needs_full = ~exact_in_cap
    if active is not None:
        needs_full = needs_full & active
    tokens = jax.lax.cond(
        jnp.any(needs_full),
        lambda _: jnp.where(exact_in_cap, cand_tokens,
                            _full_vocab_choice(scaled, lse, keys, k_eff, top_p, greedy)),
        lambda _: cand_tokens,
        None,
    ).astype(jnp.int32)
    logprobs = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - lse
    return tokens, logprobs
