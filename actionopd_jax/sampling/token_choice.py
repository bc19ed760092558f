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
a CPU (transformers spends most of its decode time there). The top `cap` candidates
(`_top_candidates`, exactly `lax.top_k`) cost a few ms and are exact whenever the kept set
lies inside the top `cap` tokens: always for 1 <= top_k <= cap, and for top_k = 0 whenever
the top-`cap` probability mass reaches top_p.
Rows outside that (top_k > cap, pure temperature sampling, or a nucleus wider than `cap`)
take an exact full-vocabulary path, run only when some row needs it (`lax.cond`). That path
never sorts either: it finds the top-k and top-p thresholds by radix select over the float
bits (32 masked sums each) and draws by a two-level inverse CDF (no vocabulary-sized noise).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from actionopd_jax.model.sharding import constrain

DEFAULT_CAP = 64

_ROWS = ("batch", None)


_BLOCK = 256  # full-vocabulary sampling: pick a block of this many ids, then an id in it


def _uniform_rows(keys: jax.Array, width: int) -> jax.Array:
    """Independent U[0, 1) draws per row from that row's own key: a row's draw does not
    depend on which other rows share the batch. One draw per row per step serves both paths
    (one PRNG hash in the program, not one per path)."""
    tiny = jnp.finfo(jnp.float32).tiny
    return jax.vmap(lambda k: jax.random.uniform(k, (width,), jnp.float32, minval=tiny))(keys)


def _first_crossing(cumulative: jax.Array, target: jax.Array, mass: jax.Array) -> jax.Array:
    """Per row, the first index whose cumulative mass exceeds target (inverse CDF), never an
    index with zero mass (float rounding can push target to the total)."""
    index = (cumulative <= target[:, None]).sum(-1)
    last_nonzero = mass.shape[-1] - 1 - jnp.argmax((mass > 0)[:, ::-1], axis=-1)
    return jnp.minimum(index, last_nonzero)


def _inverse_cdf(weights: jax.Array, u_block: jax.Array, u_inner: jax.Array) -> jax.Array:
    """Exact categorical draw proportional to weights [B, V] (not normalised) from two
    uniforms per row: a block of _BLOCK ids by its mass, then an id within it. Only one pass
    over the vocabulary plus work on [B, V / _BLOCK] and [B, _BLOCK]."""
    b, vocab = weights.shape
    n_blocks = -(-vocab // _BLOCK)
    blocks = jnp.pad(weights, ((0, 0), (0, n_blocks * _BLOCK - vocab))).reshape(b, n_blocks, _BLOCK)
    block_mass = blocks.sum(-1)
    block = _first_crossing(jnp.cumsum(block_mass, -1), u_block * block_mass.sum(-1), block_mass)
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    chosen_mass = jnp.take_along_axis(block_mass, block[:, None], axis=1)[:, 0]
    offset = _first_crossing(jnp.cumsum(inner, -1), u_inner * chosen_mass, inner)
    return (block * _BLOCK + offset).astype(jnp.int32)


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
    # top_p >= 1 keeps the whole top-k set even when float rounding of the cumulative sum
    # would put the last tokens' "mass above" at the total
    return in_k & ((above < top_p[:, None] * mass_k[:, None]) | (rank == 0) | (top_p[:, None] >= 1.0))


def _sample_rank(vals_desc, keep, uniforms, greedy):
    """Gumbel-max over the kept entries of a descending list -> the chosen rank; greedy rows
    take rank 0."""
    noise = -jnp.log(-jnp.log(uniforms))
    choice = jnp.argmax(jnp.where(keep, vals_desc + noise, -jnp.inf), axis=-1)
    return jnp.where(greedy, 0, choice)


def _sortable_bits(x: jax.Array) -> jax.Array:
    """uint32 keys with the same order as the float32 values (radix-select on them is exact)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    bits = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negatives: reverse their order
    return jax.lax.bitcast_convert_type(bits, jnp.uint32) ^ jnp.uint32(0x80000000)


def _radix_select(keys: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the largest u with sum(weights[keys >= u]) >= target, built bit by bit from
    the top: 32 masked sums over the vocabulary, no sort. keys u32[B, V]; target [B]."""

    def one_bit(i, best):
        trial = best | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        mass = jnp.where(keys >= trial[:, None], weights, 0).sum(-1)
        return jnp.where(mass >= target, trial, best)

    return jax.lax.fori_loop(0, 32, one_bit, jnp.zeros(keys.shape[:1], jnp.uint32))


def _full_vocab_choice(scaled, lse, u_block, u_inner, k_eff, top_p, greedy):
    """Exact path over the whole vocabulary, without sorting it: top-k's threshold is the
    k-th largest value (radix select on counts); top-p's is the smallest value whose mass
    strictly above is < top_p * mass(top-k) (radix select on probability mass). A token is
    kept iff its value is >= both thresholds; then an inverse-CDF draw over the kept mass."""
    vocab = scaled.shape[-1]
    sort_keys = _sortable_bits(scaled)
    truncating = ((k_eff < vocab) | (top_p < 1.0)) & ~greedy

    def thresholds(_):
        kth = jnp.where(k_eff < vocab, _radix_select(sort_keys, jnp.ones((), jnp.float32), k_eff.astype(jnp.float32)),
                        jnp.uint32(0))
        in_k = sort_keys >= kth[:, None]
        probs = jnp.where(in_k, jnp.exp(scaled - lse[:, None]), 0.0)
        nucleus = _radix_select(sort_keys, probs, top_p * probs.sum(-1))
        nucleus = jnp.where(top_p >= 1.0, jnp.uint32(0), nucleus)
        return jnp.maximum(kth, nucleus)

    floor = jax.lax.cond(jnp.any(truncating), thresholds,
                         lambda _: jnp.zeros(scaled.shape[:1], jnp.uint32), None)
    kept_probs = jnp.where(sort_keys >= floor[:, None], jnp.exp(scaled - lse[:, None]), 0.0)
    return _inverse_cdf(kept_probs, u_block, u_inner)


_STRIDE_GROUPS = 16  # candidate search: about this many ids per group, strided across the vocabulary


def _group_size(vocab: int) -> int:
    """Members per candidate group: a divisor of the vocabulary near _STRIDE_GROUPS when one
    exists (then the grouped view of the logits is a free reshape; with a remainder, slicing
    it off copied the whole logits array: ~3 ms per step at 32 x 151669), else
    _STRIDE_GROUPS with the remainder handled as extra candidates."""
    divisors = [g for g in range(8, 65) if vocab % g == 0]
    return min(divisors, key=lambda g: (abs(g - _STRIDE_GROUPS), g)) if divisors else _STRIDE_GROUPS


def _same_layout(values: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pin a `lax.cond` branch's [rows, cap] results to one sharding (rows over the batch
    axes) under a mesh. Without it, the SPMD partitioner gave the candidate ids (built from
    iotas in one branch) a replicated layout in one branch and a row-sharded one in the other,
    and TPU compilation failed (`conditional` shape mismatch: s32[16,64] vs s32[4,64])."""
    return constrain(values, _ROWS), constrain(ids, _ROWS)


def _top_candidates(logits: jax.Array, cap: int, *, vocab_major: bool = False) -> tuple[jax.Array, jax.Array]:
    """Exactly `lax.top_k(logits, cap)` (same values, same ids, ties to the lower id), with
    less work on the vocabulary: split the ids into groups of `size` (_group_size) strided ids
    (group j = {j, j + n, j + 2n, ...}), take each group's maximum (one cheap pass), keep
    the cap + 1 best groups, then top_k over their members only.

    Why exact: if the cap-th best group maximum is strictly above the (cap+1)-th (which is
    >= every dropped group's), every dropped id has `cap` kept ids strictly above it, so the
    true top `cap` lie in the kept groups. The members are laid out in increasing id order
    (sorted group ids; member r of group j is r * n + j), so top_k's tie rule (lower
    position first) is the lower-id rule. When those two maxima tie (only with exactly equal
    logits), the plain `lax.top_k` runs instead (`lax.cond`: free when not taken).

    vocab_major: logits are laid out [V, rows] instead of [rows, V] (the CPU backend's
    checked head: its matmul is faster with that output on CPU, checked_head.py); results
    are [rows, cap] either way."""
    rows, vocab = logits.shape[::-1] if vocab_major else logits.shape
    row_major = lambda: logits.T if vocab_major else logits   # only off the fast path
    size = _group_size(vocab)
    n = vocab // size
    if n <= cap + 1:  # small vocabulary: nothing to gain
        return jax.lax.top_k(row_major(), cap)
    if vocab_major:
        body = (logits if n * size == vocab else logits[:n * size]).reshape(size, n, rows)
        group_max = body.max(axis=0).T
    else:
        body = (logits if n * size == vocab else logits[:, :n * size]).reshape(rows, size, n)
        group_max = body.max(axis=1)
    # keep cap + 1 groups; never slice a top_k result: XLA then rewrites the top_k as a full
    # sort of its operand (measured: +80 ms here, +1.2 s on the vocabulary)
    group_max, groups = jax.lax.top_k(group_max, cap + 1)
    kept = groups.shape[-1]
    # exact iff the cap-th best kept maximum is strictly above the last kept one (>= every
    # dropped group's): i.e. the smallest kept maximum is unique
    boundary_tie = jnp.any((group_max == group_max.min(-1, keepdims=True)).sum(-1) > 1)

    def from_groups(_):
        order = jnp.sort(groups, axis=-1)
        member_ids = jnp.arange(size, dtype=jnp.int32)[None, :, None] * n + order[:, None, :]   # [rows, size, kept]
        # ids past the last full stride (fewer than `size` of them) are always candidates
        tail_ids = jnp.arange(n * size, vocab, dtype=jnp.int32)
        if vocab_major:
            members = logits.at[member_ids, jnp.arange(rows)[:, None, None]].get(mode="promise_in_bounds")
            tail = logits[n * size:].T
        else:
            members = jnp.take_along_axis(body, jnp.broadcast_to(order[:, None, :], (rows, size, kept)), axis=2)
            tail = logits[:, n * size:]
        pool = jnp.concatenate([members.reshape(rows, -1), tail], axis=-1)
        pool_ids = jnp.concatenate([member_ids.reshape(rows, -1), jnp.broadcast_to(tail_ids, (rows, tail_ids.size))],
                                   axis=-1)
        values, at = jax.lax.top_k(pool, cap)
        return _same_layout(values, jnp.take_along_axis(pool_ids, at, axis=-1))

    def plain(_):
        return _same_layout(*jax.lax.top_k(row_major(), cap))

    return jax.lax.cond(boundary_tie, plain, from_groups, None)


def choose_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, *, cap: int = DEFAULT_CAP,
                  active: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row.

    logits f32[B, V]; keys: [B] typed PRNG keys (one per row, already folded with the step);
    temperature f32[B] (0 = greedy); top_k i32[B] (0 = off); top_p f32[B] in (0, 1];
    active bool[B] (rows that still need a token: finished rows never force the slow path).
    Returns (tokens i32[B], logprobs f32[B]).

    Vocabulary-sized work on the common path is two passes: the group maxima of the
    candidate search (`_top_candidates`) and one fused exp-sum (the normaliser). Candidates
    come from the raw logits (dividing by T > 0 keeps their order) and the row maximum is the
    best candidate, so no tempered copy of the logits and no separate max pass exist unless
    the full-vocabulary branch runs.
    """
    vocab = logits.shape[-1]
    cap = min(cap, vocab)
    logits = logits.astype(jnp.float32)
    greedy, temp = greedy_and_temperature(temperature)

    cand_logits, cand_idx = _top_candidates(logits, cap)
    # the row maximum; a max over the candidates, not a slice of them: XLA rewrites a sliced
    # top_k into a full sort of the vocabulary (measured: 1.2 s per call)
    top = cand_logits.max(-1, keepdims=True)
    # log-normaliser of logits / T, shifted by the row maximum: lse = top / T + log_norm
    # (one fused exp-sum pass, ~4-6 ms at 32 x 151669; splitting it into an exp pass and a sum,
    # two-stage sums or a hand-written exp did not beat it measurably)
    log_norm = jnp.log(jnp.exp((logits - top) / temp[:, None]).sum(-1))
    pick = pick_from_candidates(cand_logits, cand_idx, top, log_norm, keys, temp, greedy, top_k, top_p, vocab)

    needs_full = ~pick.exact
    if active is not None:
        needs_full = needs_full & active

    def full_path(_):
        # rare: rebuild the tempered logits only here (the branch costs nothing when not taken)
        scaled = logits / temp[:, None]
        lse = top[:, 0] / temp + log_norm
        full_tokens = _full_vocab_choice(scaled, lse, pick.uniforms[:, cap], pick.uniforms[:, cap + 1], pick.k_eff,
                                         top_p, greedy)
        full_logprobs = jnp.take_along_axis(scaled, full_tokens[:, None], axis=-1)[:, 0] - lse
        return (jnp.where(pick.exact, pick.tokens, full_tokens),
                jnp.where(pick.exact, pick.logprobs, full_logprobs))

    tokens, logprobs = jax.lax.cond(jnp.any(needs_full), full_path, lambda _: (pick.tokens, pick.logprobs), None)
    return tokens.astype(jnp.int32), logprobs


def greedy_and_temperature(temperature: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(greedy rows, the temperature each row's logprob is reported at: 1 for greedy rows)."""
    greedy = temperature <= 0.0
    return greedy, jnp.where(greedy, 1.0, temperature).astype(jnp.float32)


def effective_top_k(top_k: jax.Array, vocab: int) -> jax.Array:
    """Per-row top-k with "off" (0) and anything >= the vocabulary mapped to the vocabulary."""
    return jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).astype(jnp.int32)


@flax.struct.dataclass
class CandidatePick:
    tokens: jax.Array      # i32[B]
    logprobs: jax.Array    # f32[B]: log_softmax(logits / T) at the token, full vocabulary
    exact: jax.Array       # bool[B]: the kept set provably lies in the candidates (else: full path)
    k_eff: jax.Array       # i32[B]: top-k with 0 / >= V mapped to V
    uniforms: jax.Array    # f32[B, cap + 2]: the row's draws (the full path uses the last two)


def pick_from_candidates(cand_logits, cand_idx, top, log_norm, keys, temp, greedy, top_k, top_p,
                         vocab: int) -> CandidatePick:
    """Top-k, top-p and the draw over the `cap` best tokens of each row.

    cand_logits/cand_idx [B, cap]: the row's best logits, descending, and their ids; top [B, 1]:
    the row maximum; log_norm [B]: log sum_v exp((logit_v - top) / T) over the whole
    vocabulary. The draw is exact for rows in `exact`; the caller redoes the others."""
    cap = cand_logits.shape[-1]
    cand_vals = (cand_logits - top) / temp[:, None]           # tempered, shifted: the best is 0
    cand_probs = jnp.exp(cand_vals - log_norm[:, None])

    k_eff = effective_top_k(top_k, vocab)
    # candidate path is exact iff the kept set provably lies in the top `cap` tokens
    nucleus_fits = (k_eff == vocab) & (top_p < 1.0) & (cand_probs.sum(-1) >= top_p)
    exact_in_cap = greedy | (k_eff <= cap) | nucleus_fits
    # top-p renormalises over the top-k set: its mass is known from the candidates when
    # k <= cap, and is the whole distribution (1) when there is no top-k. Rows with
    # cap < k < V get a placeholder here; their candidate result is discarded by the caller.
    in_cap_k = jnp.minimum(k_eff, cap)
    cand_mass_k = jnp.where(k_eff == vocab, 1.0,
                            jnp.where(jnp.arange(cap)[None, :] < in_cap_k[:, None], cand_probs, 0.0).sum(-1))
    keep = _nucleus_keep(cand_probs, in_cap_k, top_p, cand_mass_k)
    uniforms = _uniform_rows(keys, cap + 2)
    choice = _sample_rank(cand_vals, keep, uniforms[:, :cap], greedy)
    tokens = jnp.take_along_axis(cand_idx, choice[:, None], axis=-1)[:, 0]
    logprobs = jnp.take_along_axis(cand_vals, choice[:, None], axis=-1)[:, 0] - log_norm
    return CandidatePick(tokens=tokens, logprobs=logprobs, exact=exact_in_cap, k_eff=k_eff, uniforms=uniforms)
