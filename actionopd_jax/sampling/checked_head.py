"""Next-token choice through a bfloat16 LM head whose candidates are checked against float32.

On CPUs with bf16 matrix units the float32 LM head is most of a decode step (bench-tiny,
32 rows: ~15 ms of ~30 ms), and the same head in bfloat16 runs about 3x faster. Rounding the
head changes the logits by a little, so a plain bf16 head would sample from a slightly
different model. This module keeps the float32 model's choice instead:

1. approximate logits l~ = bf16(h) . bf16(W_v), float32 accumulation, for the whole vocabulary,
   laid out [V, B] (vocabulary-major: the faster matmul on CPU, see `choose_tokens_checked`);
2. a rigorous per-row bound `delta >= |l_v - l~_v|` for every v, where l is the float32
   logit (see `error_bound`);
3. the `search` best ids of l~ (the set R), and their float32 logits recomputed exactly (a
   gather of `search` rows of W and a small matmul);
4. a row is *checked* when the ranks the draw can use (the top-k set; rank 0 for greedy) are
   provably inside R: the k-th best float32 logit in R exceeds B + delta, where B = l~ at the
   last rank of R bounds l~ outside R, so every id outside R has l <= B + delta. Then the
   float32 top-`cap` order, top-k, top-p and the draw come from the exact logits of R, with
   the row's own uniforms: the token is the one the float32 head would pick
   (`token_choice.choose_tokens` on `model.logits`), up to the last-bit rounding differences
   between two float32 matmul kernels.
5. rows that are not checked take the float32 path: the full float32 head and
   `choose_tokens`, in a `lax.cond` branch that costs nothing when no active row needs it.
   When an active row's settings alone rule the check out (top-k off or above `cap`), the
   step skips steps 1-4 and runs only the float32 path (pure-temperature sampling costs what
   the float32 mode costs).

The logprob of a checked row is l_tok / T - LSE with the float32 logit of the token and a
log-normaliser that uses exact logits for the searched ids and l~ for the rest. That
normaliser is not exact: the rounding of h is shared by every id, so its error does not
average away; it is about 2^-9 of the logits' scale times their spread. Measured against the
float32 mode with the same keys: max |logprob difference| ~2e-4 on bench-tiny (T = 0.6,
logit std 0.3), 3.2e-4 on bench-small, 2e-3 on a sharper random head (logit std 2.4, tests/test_checked_head.py).
The tokens are the same. The trainer recomputes behaviour logprobs by default
(train.old_logprobs=recompute), so this only touches the sampler's reported logprobs; use
Sampler(lm_head="float32") where exact float32 normalisers matter more than speed.

Part of the CPU backend (cpu_backend.py); applies only to a float32 head there
(decode.uses_checked_head): the bound assumes true float32 matmuls, which TPUs and GPUs do
not run by default, and a bfloat16 model's own head is already bfloat16. Elsewhere the
caller uses `model.logits` directly.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from actionopd_jax.sampling.token_choice import (DEFAULT_CAP, _group_size, _top_candidates, choose_tokens,
                                                 effective_top_k, greedy_and_temperature, pick_from_candidates)

DEFAULT_SEARCH = DEFAULT_CAP  # ids whose float32 logits are recomputed per row per step

_ROUND_F32 = 2.0 ** -24  # unit roundoff of float32 (round to nearest)


@flax.struct.dataclass
class CheckedHead:
    """The head's bf16 copy and the norms the error bound needs (built outside the decode
    loop; the Sampler keeps it while the head weights stay the same)."""

    w16: jax.Array          # bf16[V, D]
    norm_max: jax.Array     # f32[]: max_v ||W_v||
    norm16_max: jax.Array   # f32[]: max_v ||bf16(W_v)||
    resid_max: jax.Array    # f32[]: max_v ||W_v - bf16(W_v)||


def checked_head(w: jax.Array) -> CheckedHead:
    w = w.astype(jnp.float32)
    w16 = w.astype(jnp.bfloat16)
    w16_f = w16.astype(jnp.float32)
    norms = lambda x: jnp.sqrt(jnp.sum(x * x, axis=-1)).max()
    return CheckedHead(w16=w16, norm_max=norms(w), norm16_max=norms(w16_f), resid_max=norms(w - w16_f))


def error_bound(head: CheckedHead, h: jax.Array, h16: jax.Array) -> jax.Array:
    """delta [B] with |l_v - l~_v| <= delta for every v, l = the float32 logit as either
    float32 kernel computes it, l~ = the bf16 head's value.

    h.W_v - h16.W16_v = (h - h16).W_v + h16.(W_v - W16_v), each bounded by Cauchy-Schwarz
    with the largest row norm of W; products of bf16 numbers are exact in float32, so the
    only other errors are float32 accumulation over D terms, at most
    gamma_D * sum_i |x_i y_i| <= gamma_D * ||x|| ||y||, once for the bf16 head and once for
    the float32 logit. A 1% factor covers the rounding of the norms themselves."""
    d = h.shape[-1]
    gamma = d * _ROUND_F32 / (1.0 - d * _ROUND_F32)
    h16 = h16.astype(jnp.float32)
    norm = lambda x: jnp.sqrt(jnp.sum(x * x, axis=-1))
    h_norm, h16_norm = norm(h), norm(h16)
    delta = (norm(h - h16) * head.norm_max + h16_norm * head.resid_max
             + gamma * (h16_norm * head.norm16_max + h_norm * head.norm_max))
    return 1.01 * delta + 1e-30


def _exp_sum_vocab_major(x: jax.Array, shift: jax.Array, temp: jax.Array) -> jax.Array:
    """sum_v exp((x[v, b] - shift[b]) / temp[b]) for x [V, B], reduced as [size, n, B] ->
    [n, B] -> [B] (size = a divisor of V near 16): one long reduction over the vocabulary
    is rewritten by CPU XLA into a reduce-window that no longer fuses with the exp (measured:
    ~10 ms per step at 32 x 151669 against ~2 ms)."""
    vocab = x.shape[0]
    size = _group_size(vocab)
    n = vocab // size
    terms = lambda y: jnp.exp((y - shift) / temp)
    total = terms(x[:n * size].reshape(size, n, -1)).sum(0).sum(0)
    return total + terms(x[n * size:]).sum(0) if n * size < vocab else total


def choose_tokens_checked(head: CheckedHead, w: jax.Array, hidden: jax.Array,
                          exact_logits: Callable[[jax.Array], jax.Array],
                          keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                          cap: int = DEFAULT_CAP, search: int = DEFAULT_SEARCH,
                          active: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`choose_tokens(exact_logits(hidden), ...)`'s tokens from the bf16 head (module docstring).

    head: `checked_head(w)`; w f32[V, D]: the float32 head;
    hidden f32[B, D]: final-normed hidden states; exact_logits: the float32 head (the model's
    own `logits`), run only in the fallback branch. Other arguments as `choose_tokens`.
    Returns (tokens, logprobs, fell_back: bool[] whether the float32 branch ran)."""
    vocab = w.shape[0]
    search = min(max(search, cap), vocab)
    cap = min(cap, search)
    greedy, temp = greedy_and_temperature(temperature)
    k_eff = effective_top_k(top_k, vocab)
    # rows whose settings the check can never settle (top-k off or above `cap`): when any is
    # active, skip the bf16 work and run the float32 head directly
    unsettled = ~(greedy | (k_eff <= cap))
    if active is not None:
        unsettled = unsettled & active

    def float32_choice():
        return choose_tokens(exact_logits(hidden), keys, temperature, top_k, top_p, cap=cap, active=active)

    def float32_only(_):
        tokens, logprobs = float32_choice()
        return tokens, logprobs, jnp.ones((), bool)

    def checked_path(_):
        h = hidden.astype(jnp.float32)
        h16 = h.astype(jnp.bfloat16)
        # l~ laid out [V, B]: with the vocabulary as the matmul's long (row) axis, CPU XLA's
        # bf16 matmul runs ~1.5x faster than with [B, V] output (bench-small, 32 rows:
        # 12.5 ms against 19-22 ms); the passes over it below read it in this layout
        approx = jnp.einsum("vd,bd->vb", head.w16, h16, preferred_element_type=jnp.float32)
        delta = error_bound(head, h, h16)

        a_vals, a_ids = _top_candidates(approx, search, vocab_major=True)   # R; never sliced (see there)
        # exact float32 logits of R, laid out in increasing id order so that top_k's tie rule
        # (lower position first) is choose_tokens' lower-id rule
        ids = jnp.sort(a_ids, axis=-1)
        exact = jnp.einsum("bd,bsd->bs", h, w.at[ids].get(mode="promise_in_bounds"), preferred_element_type=jnp.float32)
        cand_logits, at = jax.lax.top_k(exact, cap)
        cand_idx = jnp.take_along_axis(ids, at, axis=-1)
        need = jnp.where(greedy, 1, jnp.minimum(k_eff, cap))    # ranks the draw can use
        kth = jnp.take_along_axis(cand_logits, (need - 1)[:, None], axis=-1)[:, 0]
        outside = a_vals.min(-1)                                 # >= l~ of every id outside R
        # every active row here is greedy or has top-k <= cap (else float32_only ran), so the
        # candidate draw is exact wherever inclusion is proven
        checked = kth > outside + delta
        top = cand_logits.max(-1, keepdims=True)                 # the row maximum when checked
        # normaliser: bf16 values everywhere, swapped for the exact ones on the searched ids
        approx_at_ids = approx.at[ids, jnp.arange(ids.shape[0])[:, None]].get(mode="promise_in_bounds")
        swap = (jnp.exp((exact - top) / temp[:, None]) - jnp.exp((approx_at_ids - top) / temp[:, None])).sum(-1)
        log_norm = jnp.log(_exp_sum_vocab_major(approx, top[:, 0], temp) + swap)
        pick = pick_from_candidates(cand_logits, cand_idx, top, log_norm, keys, temp, greedy, top_k, top_p, vocab)

        fallback = ~checked if active is None else ~checked & active

        def float32_path(_):
            tokens, logprobs = float32_choice()
            return jnp.where(fallback, tokens, pick.tokens), jnp.where(fallback, logprobs, pick.logprobs)

        fell_back = jnp.any(fallback)
        tokens, logprobs = jax.lax.cond(fell_back, float32_path, lambda _: (pick.tokens, pick.logprobs), None)
        return tokens.astype(jnp.int32), logprobs, fell_back

    return jax.lax.cond(jnp.any(unsettled), float32_only, checked_path, None)
