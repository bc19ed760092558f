"""The two compiled programs of generation: prefill, then a `lax.while_loop` decode.

Shapes are static (bucketed by the caller); everything else is traced data.

Rows are laid out prompt-major: row r = prompt r // G, sample r % G (G = samples per prompt,
bucketed). The prompt's keys/values are computed once by the model's own cached forward
(prefill) and then SHARED by its G samples: decode attention reads each prompt's cache once
for all of its samples instead of once per sample (N=4 candidates per state read a quarter of
the prompt cache they would read with copied rows). Only the generated tokens have per-row
cache slots. Cache layouts make every attention contraction a canonical batched matmul
[m, k] @ [k, n] with the (prompt, kv head) batch axes leading: keys are stored transposed
([.., head_dim, slots]), values as [.., slots, head_dim]. (Measured on CPU XLA: with values
contracted over a non-minor axis, the prompt's probs @ values ran as a generic ~1.5 ms dot per
layer per step.)

Decode runs the model's own layer modules (norms, q/k/v projections with q/k-norm and RoPE,
output projection, MLP, LM head); only the attention over the split cache lives here. The
tests check it token-for-token against full forwards of the model.

Sampled ids include the end token when one was produced (the policy chose to stop, so it
belongs to the response); `lengths` counts it.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from actionopd_jax.model import KVCache, left_pad_positions
from actionopd_jax.model.layers import rope_cos_sin
from actionopd_jax.sampling.checked_head import CheckedHead, checked_head, choose_tokens_checked
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
    """Keys/values of the prompts, shared by their samples. Per layer: keys [P_rows, KVH, Dh, P]
    (transposed), values [P_rows, KVH, P, Dh]."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array         # bool[P_rows, P]: real (non-pad) prompt tokens


@flax.struct.dataclass
class DecodeState:
    prompt: PromptCache
    # generated tokens' cache, per layer a tuple of blocks (attention_spans): keys (transposed)
    # [P_rows, KVH, G, Dh, n_j], values [P_rows, KVH, G, n_j, Dh]; the blocks' n_j sum to N
    gen_k: tuple[tuple[jax.Array, ...], ...]
    gen_v: tuple[tuple[jax.Array, ...], ...]
    tokens: jax.Array        # i32[R, N]: sampled ids (junk after a row's length)
    logprobs: jax.Array      # f32[R, N]
    last: jax.Array          # i32[R]: the most recent token of each row
    next_pos: jax.Array      # i32[R]: RoPE position of that token
    lengths: jax.Array       # i32[R]: tokens produced so far
    done: jax.Array          # bool[R]
    stopped: jax.Array       # bool[R]: finished on an end token (else: length)
    step: jax.Array          # i32[]: index of the next token to produce
    head_fallbacks: jax.Array  # i32[]: decode steps where the "checked" head ran the float32 head


HEAD_MODES = ("checked", "float32", "bfloat16")


def lm_head_weights(model, head: str) -> jax.Array | None:
    """The LM head's weights for the "bfloat16" mode (cast once per program, outside the
    decode loop), or None: the model's own head (`model.logits`)."""
    return model.head_weight().astype(jnp.bfloat16) if head == "bfloat16" else None


def _logits(model, hidden: jax.Array, head_w: jax.Array | None) -> jax.Array:
    """Next-token logits f32[R, V]. Default: `model.logits` (the trainer's exact float32 head).
    "bfloat16" mode (Sampler(lm_head="bfloat16")): hidden and weights rounded to bfloat16,
    float32 accumulation; the logits (and so the reported logprobs and the samples) are then
    those of the rounded head, no longer the float32 model's."""
    if head_w is None:
        return model.logits(hidden)
    return jnp.einsum("bd,vd->bv", hidden.astype(head_w.dtype), head_w, preferred_element_type=jnp.float32)


def uses_checked_head(model, head: str) -> bool:
    """The "checked" head applies to a float32 head on CPU only: its error bound assumes true
    float32 matmuls (TPUs' and GPUs' default f32 precision uses bf16/tf32 passes), and on
    accelerators models run in bf16 anyway. Elsewhere "checked" means the model's own head."""
    return (head == "checked" and model.head_weight().dtype == jnp.float32
            and jax.default_backend() == "cpu")


def token_chooser(model, head: str, *, cap: int, checked: CheckedHead | None = None):
    """(hidden [R, D] (final-normed), keys, rows, active) -> (tokens, logprobs, fell_back) for
    one step (fell_back: the "checked" mode needed the float32 head this step).

    "checked" (default): a bfloat16 head whose candidates are checked against float32
    (checked_head.py): the float32 model's tokens at about a third of the head's cost. It
    needs a float32 head on CPU (`uses_checked_head`); otherwise the model's own head runs.
    "float32": `model.logits` and `choose_tokens`. "bfloat16": the head rounded to bfloat16
    (samples from the rounded model)."""
    if head not in HEAD_MODES:
        raise ValueError(f"lm_head must be one of {HEAD_MODES}, got {head!r}")
    if uses_checked_head(model, head):
        if checked is None:
            checked = checked_head(model.head_weight())  # loop-invariant: built once per call

        def choose(hidden, keys, rows: RowSettings, active):
            return choose_tokens_checked(checked, model.head_weight(), hidden, model.logits, keys,
                                         rows.temperature, rows.top_k, rows.top_p, cap=cap, active=active)
        return choose
    head_w = lm_head_weights(model, head)

    def choose(hidden, keys, rows: RowSettings, active):
        tokens, logprobs = choose_tokens(_logits(model, hidden, head_w), keys, rows.temperature, rows.top_k,
                                         rows.top_p, cap=cap, active=active)
        return tokens, logprobs, jnp.zeros((), bool)
    return choose


def fuse_step_weights() -> bool:
    """Whether decode runs on fused, output-major copies of the layer weights: on CPU only,
    where they are faster (`step_weights`); on accelerators the copies would cost as much
    memory again as the layer weights, for matmuls that are not the bottleneck there."""
    return jax.default_backend() == "cpu"


def step_weights(layer) -> tuple:
    """(qkv, o, gate_up, down) weights for a layer's decode steps, built once per call.
    Fused and output-major when `fuse_step_weights()`: q/k/v and gate/up side by side (two
    matmuls per layer per step instead of five; each small matmul costs ~0.1 ms of fixed
    overhead on CPU), every weight [N, K] (layers.dense_output_major: YNN streams those
    1.2-1.4x faster). Otherwise all None: the modules' own weights."""
    if not fuse_step_weights():
        return None, None, None, None
    return (layer.self_attn.fused_qkv_weight(), layer.self_attn.output_major_o_weight(),
            layer.mlp.fused_gate_up_weight(), layer.mlp.output_major_down_weight())


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
            rows: RowSettings, end_ids: jax.Array, *, samples: int, max_new: int, cap: int,
            head: str = "checked", span_ladder: tuple[int, ...] = ()) -> DecodeState:
    """Prompts [P_rows, P] (left-padded, mask True on real tokens) -> state after token 0 of
    each of the P_rows * samples rows. span_ladder: where the generated cache is split into
    blocks (`attention_spans`; decode runs one phase per block)."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    n_prompts, prompt_len = prompt_tokens.shape
    cache = KVCache.init(cfg, n_prompts, prompt_len)
    hidden, cache = model(prompt_tokens, left_pad_positions(prompt_mask), attention_mask=prompt_mask, cache=cache)
    # the first token from the float32 head (a once-per-call cost) unless the rounded
    # "bfloat16" mode was asked for; left padding: the last position is real
    logits = _logits(model, hidden[:, -1], lm_head_weights(model, head))
    layers = range(cfg.num_hidden_layers)
    prompt = PromptCache(k=tuple(cache.k[i].transpose(0, 2, 3, 1) for i in layers),
                         v=tuple(cache.v[i].transpose(0, 2, 1, 3) for i in layers), valid=prompt_mask)
    n_rows = n_prompts * samples
    kvh, dh = cfg.num_key_value_heads, cfg.head_dim
    ends = attention_spans(max_new, span_ladder)
    sizes = [end - start for start, end in zip((0,) + ends[:-1], ends)]
    state = DecodeState(
        prompt=prompt,
        gen_k=tuple(tuple(jnp.zeros((n_prompts, kvh, samples, dh, n), cache.k.dtype) for n in sizes) for _ in layers),
        gen_v=tuple(tuple(jnp.zeros((n_prompts, kvh, samples, n, dh), cache.v.dtype) for n in sizes) for _ in layers),
        tokens=jnp.zeros((n_rows, max_new), jnp.int32),
        logprobs=jnp.zeros((n_rows, max_new), jnp.float32),
        last=jnp.zeros((n_rows,), jnp.int32),
        next_pos=jnp.repeat(prompt_mask.sum(-1).astype(jnp.int32), samples),
        lengths=jnp.zeros((n_rows,), jnp.int32),
        done=rows.max_new <= 0,
        stopped=jnp.zeros((n_rows,), bool),
        step=jnp.zeros((), jnp.int32),
        head_fallbacks=jnp.zeros((), jnp.int32),
    )
    tok, logp = choose_tokens(jnp.repeat(logits, samples, axis=0), _step_keys(rows.keys, state.step),
                              rows.temperature, rows.top_k, rows.top_p, cap=cap, active=~state.done)
    return _record(state, tok, logp, rows, end_ids)


def _shared_prefix_attention(q, prompt_k, prompt_v, prompt_valid, gen_blocks, last_visible, dtype):
    """Softmax attention of decode queries over [own prompt slots | own generated slots].

    q: [P_rows, KVH, G, Gq, Dh] (Gq = query heads per KV head); prompt_k: [P_rows, KVH, Dh, P];
    prompt_v: [P_rows, KVH, P, Dh]; prompt_valid: bool[P_rows, P]; gen_blocks: the generated
    cache's blocks in slot order, pairs (keys [P_rows, KVH, G, Dh, n], values
    [P_rows, KVH, G, n, Dh]), every slot visible except in the last block, where
    last_visible bool[n_last] says which are. The G samples' queries of a prompt are the rows
    of one matmul against its shared prompt cache. Scores and softmax in float32 (as the
    model's attention). Returns [P_rows, KVH, G, Gq, Dh].
    """
    n_prompts, kvh, samples, gq, dh = q.shape
    scale = dh ** -0.5
    q_rows = q.reshape(n_prompts, kvh, samples * gq, dh)
    s_prompt = jnp.einsum("pkmd,pkds->pkms", q_rows, prompt_k, preferred_element_type=jnp.float32) * scale
    s_prompt = s_prompt.reshape(n_prompts, kvh, samples, gq, -1)
    scores = [jnp.where(prompt_valid[:, None, None, None, :], s_prompt, _MASKED)]
    for j, (gen_k, _) in enumerate(gen_blocks):
        s_gen = jnp.einsum("pkghd,pkgdn->pkghn", q, gen_k, preferred_element_type=jnp.float32) * scale
        scores.append(jnp.where(last_visible, s_gen, _MASKED) if j == len(gen_blocks) - 1 else s_gen)
    top = functools.reduce(jnp.maximum, [s.max(-1, keepdims=True) for s in scores])
    exps = [jnp.exp(s - top) for s in scores]
    denom = functools.reduce(jnp.add, [e.sum(-1, keepdims=True) for e in exps])
    probs = [(e / denom).astype(dtype) for e in exps]
    out = jnp.einsum("pkms,pksd->pkmd", probs[0].reshape(n_prompts, kvh, samples * gq, -1),
                     prompt_v.astype(dtype)).reshape(q.shape)
    for p_gen, (_, gen_v) in zip(probs[1:], gen_blocks):
        out = out + jnp.einsum("pkghn,pkgnd->pkghd", p_gen, gen_v.astype(dtype))
    return out


def attention_spans(max_new: int, ladder: tuple[int, ...]) -> tuple[int, ...]:
    """Ends of the generated cache's blocks (decode's phases): the ladder's sizes below the
    buffer length, then the buffer length. Block j holds slots [spans[j-1], spans[j])."""
    return tuple(int(s) for s in ladder if 0 < s < max_new) + (max_new,)


def decode(graphdef: nnx.GraphDef, params: Any, state: DecodeState, rows: RowSettings,
           end_ids: jax.Array, checked: CheckedHead | None = None, *, cap: int,
           head: str = "checked") -> DecodeState:
    """Generate until all rows are done or the token buffer is full (early exit).
    checked: the "checked" head's bf16 copy and norms when the caller keeps them between
    calls (Sampler does, per head-weight array); None builds them inside this call.

    The loop runs in phases, one `while_loop` per block of the generated cache
    (`attention_spans`): phase j writes block j and attends over blocks 0..j only, so
    attention over generated tokens costs what the tokens made so far need, not what the
    buffer holds (a 4096-slot buffer with 100-token replies reads 128 slots per step).
    Blocks are separate arrays because a slice of one buffer is a copy on CPU XLA
    (measured: +9 ms per step on bench-small). Each phase is one more copy of the loop body
    in the program (compile time)."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    dt = jnp.dtype(cfg.dtype)
    n_prompts, kvh, samples = state.gen_k[0][0].shape[:3]
    n_rows = n_prompts * samples
    max_new = state.tokens.shape[1]
    block_ends = tuple(int(e) for e in np.cumsum([b.shape[-1] for b in state.gen_k[0]]))
    layer_def, layer_state = nnx.split(model.layers)
    # one module per layer, sliced once per call (loop-invariant), not once per step: a
    # temporary copy of the layer weights (not of the embedding / LM head) for the call
    layers = [nnx.merge(layer_def, jax.tree.map(lambda x, i=i: x[i], layer_state))
              for i in range(cfg.num_hidden_layers)]
    fused = [step_weights(layer) for layer in layers]
    prompt = state.prompt
    choose = token_chooser(model, head, cap=cap, checked=checked)
    # RoPE cos/sin of every position this call can reach, computed once: computed per step,
    # XLA fused them into each layer's q and k fusions and evaluated them per element there
    cos_table, sin_table = (t[0] for t in rope_cos_sin(jnp.arange(prompt.valid.shape[-1] + max_new)[None],
                                                       cfg.head_dim, cfg.rope_theta))   # [positions, Dh]

    def one_token(s: DecodeState, block: int) -> DecodeState:
        start = block_ends[block - 1] if block else 0
        slot = s.step - 1 - start              # the fed token (made at step-1) goes to slot step-1, here in the block
        visible = jnp.arange(block_ends[block] - start) <= slot
        positions = s.next_pos[:, None]
        h = jnp.take(model.embed_tokens[...], s.last[:, None], axis=0).astype(dt)   # [R, 1, D]
        cos = jnp.take(cos_table, positions, axis=0, mode="clip")   # [R, 1, Dh]
        sin = jnp.take(sin_table, positions, axis=0, mode="clip")
        gen_k, gen_v = [list(b) for b in s.gen_k], [list(b) for b in s.gen_v]
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            qkv_w, o_w, gate_up_w, down_w = fused[i]
            q, k, v = attn.project_qkv(layer.input_layernorm(h), cos, sin, qkv_w)  # [R, 1, heads, Dh]
            # rows (prompt-major) -> [P_rows, KVH, G, ...]: transposes of small per-step arrays only
            k = k.reshape(n_prompts, samples, kvh, -1).transpose(0, 2, 1, 3)[..., None]   # [P, KVH, G, Dh, 1]
            v = v.reshape(n_prompts, samples, kvh, -1).transpose(0, 2, 1, 3)[..., None, :]
            bk, bv = gen_k[i][block], gen_v[i][block]
            gen_k[i][block] = jax.lax.dynamic_update_slice(bk, k.astype(bk.dtype), (0, 0, 0, 0, slot))
            gen_v[i][block] = jax.lax.dynamic_update_slice(bv, v.astype(bv.dtype), (0, 0, 0, slot, 0))
            qg = attn.group_queries(q)[:, 0]                                          # [R, KVH, Gq, Dh]
            qg = qg.reshape(n_prompts, samples, *qg.shape[1:]).transpose(0, 2, 1, 3, 4)
            out = _shared_prefix_attention(qg, prompt.k[i], prompt.v[i], prompt.valid,
                                           list(zip(gen_k[i], gen_v[i]))[:block + 1], visible, dt)
            out = out.transpose(0, 2, 1, 3, 4).reshape(n_rows, 1, kvh, *out.shape[3:])   # [R, 1, KVH, Gq, Dh]
            h = h + attn.output(out, o_w)
            h = h + layer.mlp(layer.post_attention_layernorm(h), gate_up_w, down_w)
        tok, logp, fell_back = choose(model.norm(h)[:, 0], _step_keys(rows.keys, s.step), rows, ~s.done)
        s = s.replace(gen_k=tuple(tuple(b) for b in gen_k), gen_v=tuple(tuple(b) for b in gen_v),
                      next_pos=s.next_pos + 1, head_fallbacks=s.head_fallbacks + fell_back.astype(jnp.int32))
        return _record(s, tok, logp, rows, end_ids)

    for block, end in enumerate(block_ends):
        # step t feeds slot t - 1: this block serves steps up to `end`
        state = jax.lax.while_loop(lambda s, end=end: (s.step < max_new) & (s.step <= end) & ~jnp.all(s.done),
                                   functools.partial(one_token, block=block), state)
    return state
