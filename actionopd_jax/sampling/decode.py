"""The two compiled programs of generation: prefill, then a `lax.while_loop` decode.

Shapes are static (bucketed by the caller); everything else is traced data:
- prefill(params, prompt tokens [P_rows, P] left-padded) runs the prompts once, takes logits
  only at the last position, copies each prompt's cache rows to the rows that sample from it
  (`row_prompt`: the n candidates of a state share one prefill), and samples token 0;
- decode(params, state) feeds one token per row per step until every row has hit an end
  token or its own max_new, or the static bucket is full. The decode state (cache included)
  is donated so the cache is updated in place.

Sampled ids include the end token when one was produced (the policy chose to stop, so it
belongs to the response); `lengths` counts it.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from actionopd_jax.model import KVCache, left_pad_positions
from actionopd_jax.sampling.token_choice import choose_tokens


@flax.struct.dataclass
class RowSettings:
    """Per-row sampling controls (all traced: changing them never recompiles)."""

    keys: jax.Array          # [R] typed PRNG keys, one per generated sequence
    temperature: jax.Array   # f32[R], 0 = greedy
    top_k: jax.Array         # i32[R], 0 = off
    top_p: jax.Array         # f32[R]
    max_new: jax.Array       # i32[R], 0 for padding rows (done before they start)


@flax.struct.dataclass
class DecodeState:
    cache: KVCache
    tokens: jax.Array        # i32[R, N]: sampled ids (junk after a row's length)
    logprobs: jax.Array      # f32[R, N]
    last: jax.Array          # i32[R]: the most recent token of each row
    next_pos: jax.Array      # i32[R]: RoPE position of that token
    lengths: jax.Array       # i32[R]: tokens produced so far
    done: jax.Array          # bool[R]
    stopped: jax.Array       # bool[R]: finished on an end token (else: length)
    step: jax.Array          # i32[]: index of the next token to produce


def _is_end(tokens: jax.Array, end_ids: jax.Array) -> jax.Array:
    return (tokens[:, None] == end_ids[None, :]).any(-1)


def _step_keys(keys: jax.Array, step: jax.Array) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)


def _record(state: DecodeState, tok, logp, rows: RowSettings, end_ids) -> DecodeState:
    """Store the token made at `state.step` for rows still running; update stop flags."""
    running = ~state.done
    step = state.step
    tokens = jax.lax.dynamic_update_slice(state.tokens, jnp.where(running, tok, 0)[:, None], (0, step))
    logprobs = jax.lax.dynamic_update_slice(state.logprobs, jnp.where(running, logp, 0.0)[:, None], (0, step))
    hit_end = running & _is_end(tok, end_ids)
    lengths = jnp.where(running, step + 1, state.lengths)
    done = state.done | hit_end | (lengths >= rows.max_new)
    return state.replace(tokens=tokens, logprobs=logprobs, last=jnp.where(running, tok, state.last),
                         lengths=lengths, done=done, stopped=state.stopped | hit_end, step=step + 1)


def prefill(graphdef: nnx.GraphDef, params: Any, prompt_tokens: jax.Array, prompt_mask: jax.Array,
            row_prompt: jax.Array, rows: RowSettings, end_ids: jax.Array, *, max_new: int,
            cap: int) -> DecodeState:
    """Prompts [P_rows, P] (left-padded, mask True on real tokens) -> state after token 0."""
    model = nnx.merge(graphdef, params)
    n_prompts, prompt_len = prompt_tokens.shape
    cache = KVCache.init(model.cfg, n_prompts, prompt_len + max_new)
    positions = left_pad_positions(prompt_mask)
    hidden, cache = model(prompt_tokens, positions, attention_mask=prompt_mask, cache=cache)
    logits = model.logits(hidden[:, -1])                     # [P_rows, V], left padding: last is real
    # fan out: row r samples from prompt row_prompt[r] (shares that prompt's prefill)
    cache = KVCache(k=cache.k[:, row_prompt], v=cache.v[:, row_prompt],
                    valid=cache.valid[row_prompt], index=cache.index)
    logits = logits[row_prompt]
    n_rows = row_prompt.shape[0]
    state = DecodeState(
        cache=cache,
        tokens=jnp.zeros((n_rows, max_new), jnp.int32),
        logprobs=jnp.zeros((n_rows, max_new), jnp.float32),
        last=jnp.zeros((n_rows,), jnp.int32),
        next_pos=prompt_mask.sum(-1).astype(jnp.int32)[row_prompt],
        lengths=jnp.zeros((n_rows,), jnp.int32),
        done=rows.max_new <= 0,
        stopped=jnp.zeros((n_rows,), bool),
        step=jnp.zeros((), jnp.int32),
    )
    tok, logp = choose_tokens(logits, _step_keys(rows.keys, state.step), rows.temperature, rows.top_k,
                              rows.top_p, cap=cap, active=~state.done)
    return _record(state, tok, logp, rows, end_ids)


def decode(graphdef: nnx.GraphDef, params: Any, state: DecodeState, rows: RowSettings,
           end_ids: jax.Array, *, cap: int) -> DecodeState:
    """Generate until all rows are done or the token buffer is full (early exit)."""
    model = nnx.merge(graphdef, params)
    max_new = state.tokens.shape[1]

    def keep_going(s: DecodeState):
        return (s.step < max_new) & ~jnp.all(s.done)

    def one_token(s: DecodeState) -> DecodeState:
        hidden, cache = model(s.last[:, None], s.next_pos[:, None], cache=s.cache)
        logits = model.logits(hidden[:, 0])
        tok, logp = choose_tokens(logits, _step_keys(rows.keys, s.step), rows.temperature, rows.top_k,
                                  rows.top_p, cap=cap, active=~s.done)
        s = s.replace(cache=cache, next_pos=s.next_pos + 1)
        return _record(s, tok, logp, rows, end_ids)

    return jax.lax.while_loop(keep_going, one_token, state)
