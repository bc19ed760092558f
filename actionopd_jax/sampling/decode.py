"""The two compiled programs of generation: prefill, then a `lax.while_loop` decode.

Shapes are static (bucketed by the caller); everything else is traced data.

Rows are laid out prompt-major: row r = prompt r // G, sample r % G (G = samples per prompt,
bucketed). The prompt's keys/values are computed once by the model's own cached forward
(prefill) and then SHARED by its G samples: decode attention reads each prompt's cache once
for all of its samples instead of once per sample (N=4 candidates per state read a quarter of
the prompt cache they would read with copied rows). Only the generated tokens have per-row
cache slots. The decode cache is kept as [rows, kv_heads, slots, head_dim] per layer so the
attention contractions need no transposes of the cache at every step.

Decode runs the model's own layer modules (norms, q/k/v projections with q/k-norm and RoPE,
output projection, MLP, LM head); only the attention over the split cache lives here. The
tests check it token-for-token against full forwards of the model.

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
from actionopd_jax.model.layers import rope_cos_sin
from actionopd_jax.sampling.token_choice import choose_tokens

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked row stays NaN-free


@flax.struct.dataclass
class RowSettings:
    """Per-row sampling controls (all traced: changing them never recompiles)."""

    keys: jax.Array          # [R] typed PRNG keys, one per generated sequence
    temperature: jax.Array   # f32[R], 0 = greedy
    top_k: jax.Array         # i32[R], 0 = off
    top_p: jax.Array         # f32[R]
    max_new: jax.Array       # i32[R], 0 for padding rows (done before they start)


@flax.struct.dataclass
class PromptCache:
    """Keys/values of the prompts, shared by their samples. Per layer: [P_rows, KVH, P, Dh]."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array         # bool[P_rows, P]: real (non-pad) prompt tokens


@flax.struct.dataclass
class DecodeState:
    prompt: PromptCache
    gen_k: tuple[jax.Array, ...]   # per layer [P_rows, G, KVH, N, Dh]: generated tokens' keys
    gen_v: tuple[jax.Array, ...]
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
            rows: RowSettings, end_ids: jax.Array, *, samples: int, max_new: int, cap: int) -> DecodeState:
    """Prompts [P_rows, P] (left-padded, mask True on real tokens) -> state after token 0 of
    each of the P_rows * samples rows."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    n_prompts, prompt_len = prompt_tokens.shape
    cache = KVCache.init(cfg, n_prompts, prompt_len)
    hidden, cache = model(prompt_tokens, left_pad_positions(prompt_mask), attention_mask=prompt_mask, cache=cache)
    logits = model.logits(hidden[:, -1])                     # left padding: the last position is real
    layers = range(cfg.num_hidden_layers)
    prompt = PromptCache(k=tuple(cache.k[i].transpose(0, 2, 1, 3) for i in layers),
                         v=tuple(cache.v[i].transpose(0, 2, 1, 3) for i in layers), valid=prompt_mask)
    n_rows = n_prompts * samples
    gen_shape = (n_prompts, samples, cfg.num_key_value_heads, max_new, cfg.head_dim)
    state = DecodeState(
        prompt=prompt,
        gen_k=tuple(jnp.zeros(gen_shape, cache.k.dtype) for _ in layers),
        gen_v=tuple(jnp.zeros(gen_shape, cache.v.dtype) for _ in layers),
        tokens=jnp.zeros((n_rows, max_new), jnp.int32),
        logprobs=jnp.zeros((n_rows, max_new), jnp.float32),
        last=jnp.zeros((n_rows,), jnp.int32),
        next_pos=jnp.repeat(prompt_mask.sum(-1).astype(jnp.int32), samples),
        lengths=jnp.zeros((n_rows,), jnp.int32),
        done=rows.max_new <= 0,
        stopped=jnp.zeros((n_rows,), bool),
        step=jnp.zeros((), jnp.int32),
    )
    tok, logp = choose_tokens(jnp.repeat(logits, samples, axis=0), _step_keys(rows.keys, state.step),
                              rows.temperature, rows.top_k, rows.top_p, cap=cap, active=~state.done)
    return _record(state, tok, logp, rows, end_ids)


def _shared_prefix_attention(q, prompt_k, prompt_v, prompt_valid, gen_k, gen_v, gen_slots_visible, dtype):
    """Softmax attention of decode queries over [own prompt slots | own generated slots].

    q: [P_rows, G, KVH, Gq, Dh] (Gq = query heads per KV head); prompt_k/v: [P_rows, KVH, P, Dh];
    gen_k/v: [P_rows, G, KVH, N, Dh]; prompt_valid: bool[P_rows, P]; gen_slots_visible: bool[N].
    Scores and softmax in float32 (as the model's attention). Returns [P_rows, G, KVH, Gq, Dh].
    """
    scale = q.shape[-1] ** -0.5
    s_prompt = jnp.einsum("pgkhd,pksd->pgkhs", q, prompt_k, preferred_element_type=jnp.float32) * scale
    s_gen = jnp.einsum("pgkhd,pgksd->pgkhs", q, gen_k, preferred_element_type=jnp.float32) * scale
    s_prompt = jnp.where(prompt_valid[:, None, None, None, :], s_prompt, _MASKED)
    s_gen = jnp.where(gen_slots_visible, s_gen, _MASKED)
    top = jnp.maximum(s_prompt.max(-1, keepdims=True), s_gen.max(-1, keepdims=True))
    e_prompt, e_gen = jnp.exp(s_prompt - top), jnp.exp(s_gen - top)
    denom = e_prompt.sum(-1, keepdims=True) + e_gen.sum(-1, keepdims=True)
    p_prompt, p_gen = (e_prompt / denom).astype(dtype), (e_gen / denom).astype(dtype)
    return (jnp.einsum("pgkhs,pksd->pgkhd", p_prompt, prompt_v.astype(dtype))
            + jnp.einsum("pgkhs,pgksd->pgkhd", p_gen, gen_v.astype(dtype)))


def decode(graphdef: nnx.GraphDef, params: Any, state: DecodeState, rows: RowSettings,
           end_ids: jax.Array, *, cap: int) -> DecodeState:
    """Generate until all rows are done or the token buffer is full (early exit)."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    dt = jnp.dtype(cfg.dtype)
    n_prompts, samples, _, max_new, _ = state.gen_k[0].shape
    n_rows = n_prompts * samples
    layer_def, layer_state = nnx.split(model.layers)
    # one module per layer, sliced once per call (loop-invariant), not once per step: a
    # temporary copy of the layer weights (not of the embedding / LM head) for the call
    layers = [nnx.merge(layer_def, jax.tree.map(lambda x, i=i: x[i], layer_state))
              for i in range(cfg.num_hidden_layers)]
    prompt = state.prompt

    def keep_going(s: DecodeState):
        return (s.step < max_new) & ~jnp.all(s.done)

    def one_token(s: DecodeState) -> DecodeState:
        slot = s.step - 1                      # the fed token (made at step-1) goes to gen slot step-1
        visible = jnp.arange(max_new) <= slot
        positions = s.next_pos[:, None]
        h = jnp.take(model.embed_tokens[...], s.last[:, None], axis=0).astype(dt)   # [R, 1, D]
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        gen_k, gen_v = list(s.gen_k), list(s.gen_v)
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            q, k, v = attn.project_qkv(layer.input_layernorm(h), cos, sin)       # [R, 1, heads, Dh]
            k = k.reshape(n_prompts, samples, 1, *k.shape[2:]).transpose(0, 1, 3, 2, 4)
            v = v.reshape(n_prompts, samples, 1, *v.shape[2:]).transpose(0, 1, 3, 2, 4)
            gen_k[i] = jax.lax.dynamic_update_slice(gen_k[i], k.astype(gen_k[i].dtype), (0, 0, 0, slot, 0))
            gen_v[i] = jax.lax.dynamic_update_slice(gen_v[i], v.astype(gen_v[i].dtype), (0, 0, 0, slot, 0))
            qg = attn.group_queries(q)[:, 0].reshape(n_prompts, samples, *attn.group_queries(q).shape[2:])
            out = _shared_prefix_attention(qg, prompt.k[i], prompt.v[i], prompt.valid, gen_k[i], gen_v[i],
                                           visible, dt)
            out = out.reshape(n_rows, 1, *out.shape[2:])
            h = h + attn.output(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = model.logits(model.norm(h)[:, 0])
        tok, logp = choose_tokens(logits, _step_keys(rows.keys, s.step), rows.temperature, rows.top_k,
                                  rows.top_p, cap=cap, active=~s.done)
        s = s.replace(gen_k=tuple(gen_k), gen_v=tuple(gen_v), next_pos=s.next_pos + 1)
        return _record(s, tok, logp, rows, end_ids)

    return jax.lax.while_loop(keep_going, one_token, state)
