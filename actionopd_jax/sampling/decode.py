"""The two compiled programs of generation: prefill, then a `lax.while_loop` decode.

Shapes are static (bucketed by the caller); everything else is traced data.

Rows are laid out prompt-major: row r = prompt r // G, sample r % G (G = samples per prompt,
bucketed). The prompt's keys/values are computed once (prefill: on the accelerator path by
`Qwen3.prefill_kv`, the fused causal attention of `model.runtime.attention` -- splash on TPU, cuDNN on
GPU -- which never materialises [T, T] scores, so 24,576-token prompts fit; on the CPU
backend by the model's cached forward) and then SHARED by its G samples: decode attention reads each prompt's cache once
for all of its samples instead of once per sample (N=4 candidates per state read a quarter of
the prompt cache they would read with copied rows). Only the generated tokens have per-row
cache slots.

The accelerator path (TPU, GPU; this module): each decode step runs the model's layers under
one `lax.scan` over the stacked layer parameters, with a stacked KV cache (prompt cache
[L, P_rows, KVH, S, Dh], generated cache [L, P_rows, KVH, G, N, Dh]: KV heads ahead of the
slots, the layout the TPU compiler picks for the attention contractions, so it copies
nothing at loop entry or per layer),
so the program holds one layer body whatever the depth. One `while_loop` runs the steps
(one attention phase: every step attends over the whole generated buffer, masked to the
slots written so far). Weights stay in the model's parameter dtype and are cast to the
compute dtype per layer as the model's forward does. Cache arrays carry sharding
constraints (prompt rows over data/fsdp, KV heads over tensor), so nothing is replicated.

The CPU backend (cpu_backend.py) keeps the same state fields in CPU-friendly layouts
(per-layer arrays, split generated-cache blocks, fused output-major weights, the "checked"
bf16 head). Which one runs is decided from the TARGET platform (`resolve_backend`: the
mesh's device platform when tracing under a mesh, else the default backend), never from the
host's default backend alone, so a CPU host compiling for TPU gets the accelerator path.

Decode runs the model's own layer modules (norms, q/k/v projections with q/k-norm and RoPE,
output projection, MLP, LM head); only the attention over the split cache lives here. The
tests check both backends token-for-token against full forwards of the model and against
each other.

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
from actionopd_jax.model.attention.decode import shared_prompt_step
from actionopd_jax.model.attention.dispatch import resolve, target_platform
from actionopd_jax.model.layers import rope_tables
from actionopd_jax.model.sharding import constrain
import actionopd_jax.sampling.cpu_backend as cpu_backend
from actionopd_jax.sampling.checked_head import CheckedHead
from actionopd_jax.sampling.token_choice import choose_tokens


BACKENDS = ("auto", "accelerator", "cpu")

# logical axis names of the decode state's arrays (model/sharding.py's rules map them to mesh axes)
_MODEL_KV = ("layers", "batch", "length", "kv_heads", "head_dim")                # the model's cache [L, B, S, KVH, Dh]
_PROMPT_KV = ("layers", "batch", "kv_heads", "length", "head_dim")               # [L, P_rows, KVH, S, Dh]
_GEN_KV = ("layers", "batch", "kv_heads", None, "length", "head_dim")            # [L, P_rows, KVH, G, N, Dh]
_ROWS = ("batch",)
_ROWS_STEPS = ("batch", "length")


def resolve_backend(backend: str = "auto", platform: str | None = None) -> str:
    """"accelerator" or "cpu". "auto": "cpu" when the target platform (`target_platform`, or
    the given one) is a CPU, else "accelerator". The accelerator path also runs on CPU when
    asked for (tests compare the two)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "cpu" if (platform or target_platform()) == "cpu" else "accelerator"


def layer_unroll_for(layer_unroll: int | None, layers: int) -> int:
    """Layers per trip of an accelerator decode's layer scan: `layer_unroll`, or for None one,
    except on GPU, where XLA:GPU copies each trip's dynamic slice of the stacked weights (and
    the static sampler's prompt cache) out before its matmuls read it: jaxlib 0.10.2 as
    copy fusions, 0.11.2 (the lent GPUs' release) as asynchronous fusions (fusion-start /
    fusion-done) of the same bytes. Compiled for an H100 (aot/gpu_topology.py), the engine's 4B
    segment at 256 rows copied 386 MiB a layer trip, about 13.6 GiB a step against a bound of
    about 34: a memory-bound step pays it in full, overlapped or not. So on GPU all layers are
    unrolled: the slices are static and read in place (under 1 MiB of copies), at 2.7x the
    segment's compile (27 s against 10 here). TPU fuses the slices: one layer a trip."""
    if layer_unroll is not None:
        return layer_unroll
    return layers if target_platform() == "gpu" else 1


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
    """Keys/values of the prompts, shared by their samples. Accelerator: stacked over layers,
    k and v [L, P_rows, KVH, S, Dh]. CPU backend: per-layer tuples,
    keys [P_rows, KVH, Dh, S] (transposed), values [P_rows, KVH, S, Dh]."""

    k: Any
    v: Any
    valid: jax.Array         # bool[P_rows, S]: real (non-pad) prompt tokens


@flax.struct.dataclass
class DecodeState:
    prompt: PromptCache
    # generated tokens' cache. Accelerator: k and v [L, P_rows, KVH, G, N, Dh]. CPU backend:
    # per layer a tuple of blocks (cpu_backend.generated_blocks)
    gen_k: Any
    gen_v: Any
    tokens: jax.Array        # i32[R, N]: sampled ids (junk after a row's length)
    logprobs: jax.Array      # f32[R, N]
    last: jax.Array          # i32[R]: the most recent token of each row
    next_pos: jax.Array      # i32[R]: RoPE position of that token
    lengths: jax.Array       # i32[R]: tokens produced so far
    done: jax.Array          # bool[R]
    stopped: jax.Array       # bool[R]: finished on an end token (else: length)
    step: jax.Array          # i32[]: index of the next token to produce
    head_fallbacks: jax.Array  # i32[]: decode steps where the "checked" head ran the float32 head


def state_shardings(state: DecodeState, mesh) -> DecodeState:
    """NamedShardings of an accelerator-layout decode state (arrays or ShapeDtypeStructs) on
    `mesh`, from the same logical names prefill constrains it with."""
    from jax.sharding import NamedSharding
    from actionopd_jax.model.sharding import logical_to_spec

    if state_backend(state) != "accelerator":
        raise ValueError("state_shardings describes the accelerator layout only")
    named = lambda axes, x: NamedSharding(mesh, logical_to_spec(axes, mesh, shape=x.shape))
    p = state.prompt
    rows = lambda x: named(_ROWS, x)
    return DecodeState(
        prompt=PromptCache(k=named(_PROMPT_KV, p.k), v=named(_PROMPT_KV, p.v), valid=named(_ROWS_STEPS, p.valid)),
        gen_k=named(_GEN_KV, state.gen_k), gen_v=named(_GEN_KV, state.gen_v),
        tokens=named(_ROWS_STEPS, state.tokens), logprobs=named(_ROWS_STEPS, state.logprobs),
        last=rows(state.last), next_pos=rows(state.next_pos), lengths=rows(state.lengths), done=rows(state.done),
        stopped=rows(state.stopped), step=named((), state.step), head_fallbacks=named((), state.head_fallbacks))


def state_backend(state: DecodeState) -> str:
    """Which backend laid out this state (decode follows prefill)."""
    return "cpu" if isinstance(state.gen_k, tuple) else "accelerator"


HEAD_MODES = ("checked", "float32", "bfloat16")


def lm_head_weights(model, head: str) -> jax.Array | None:
    """The LM head's weights for the "bfloat16" mode (cast once per program, outside the
    decode loop), or None: the model's own head (`model.logits`)."""
    return model.head_weight().astype(jnp.bfloat16) if head == "bfloat16" else None


def _logits(model, hidden: jax.Array, head_w: jax.Array | None) -> jax.Array:
    """Next-token logits f32[R, V]. Default: `model.logits` (the trainer's head: float32
    accumulation over the head's own dtype). "bfloat16" mode (Sampler(lm_head="bfloat16")):
    hidden and weights rounded to bfloat16, float32 accumulation; the logits (and so the
    reported logprobs and the samples) are then those of the rounded head."""
    if head_w is None:
        return model.logits(hidden)
    return jnp.einsum("bd,vd->bv", hidden.astype(head_w.dtype), head_w, preferred_element_type=jnp.float32)


def uses_checked_head(model, head: str, backend: str = "auto") -> bool:
    """Whether decode runs the "checked" bf16 head: the CPU backend with a float32 head only
    (cpu_backend.uses_checked_head). Elsewhere "checked" means the model's own head."""
    return resolve_backend(backend) == "cpu" and cpu_backend.uses_checked_head(model.head_weight(), head)


def token_chooser(model, head: str, *, cap: int, backend: str = "auto", checked: CheckedHead | None = None):
    """(hidden [R, D] (final-normed), keys, rows, active) -> (tokens, logprobs, fell_back) for
    one step (fell_back: the "checked" mode needed the float32 head this step).

    Accelerators: `model.logits` (or the rounded "bfloat16" head) and `choose_tokens`.
    CPU backend, float32 head, "checked" (the default mode): a bfloat16 head whose candidates
    are checked against float32 (checked_head.py): the float32 model's tokens at about a
    third of the head's cost. "float32": the model's own head everywhere."""
    if head not in HEAD_MODES:
        raise ValueError(f"lm_head must be one of {HEAD_MODES}, got {head!r}")
    if uses_checked_head(model, head, backend):
        return cpu_backend.checked_chooser(model, checked, cap=cap)
    head_w = lm_head_weights(model, head)

    def choose(hidden, keys, rows: RowSettings, active):
        tokens, logprobs = choose_tokens(_logits(model, hidden, head_w), keys, rows.temperature, rows.top_k,
                                         rows.top_p, cap=cap, active=active)
        return tokens, logprobs, jnp.zeros((), bool)
    return choose


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


def attention_spans(max_new: int, ladder: tuple[int, ...]) -> tuple[int, ...]:
    """Ends of the CPU backend's generated-cache blocks (its decode phases): the ladder's
    sizes below the buffer length, then the buffer length. Block j holds slots
    [spans[j-1], spans[j])."""
    return tuple(int(s) for s in ladder if 0 < s < max_new) + (max_new,)


def prefill_layout(runtime, platform: str | None = None) -> str:
    """How the accelerator path lays out prompts for prefill: "left" (as the Sampler pads
    them) for splash (TPU: padding through segment ids, any layout), the XLA reference and
    the CPU blocked path; "right" for cuDNN (GPU: `runtime.attention` "auto"/"cudnn" on a GPU
    target), whose flash attention takes padding as sequence lengths, so valid tokens must be
    a prefix. Decision: on GPU the prompts are right-aligned inside the prefill program (a
    per-row roll of the int32 tokens, `right_align`) rather than falling back to the
    materialising "xla" attention; decode reads the prompt cache through its validity mask
    and RoPE positions count real tokens, so either layout decodes the same."""
    return "right" if resolve(runtime.attention, platform) == "cudnn" else "left"


def right_align(tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Left-padded rows [B, T] (mask True on real tokens) -> the same rows right-padded."""
    pad = tokens.shape[1] - mask.sum(-1).astype(jnp.int32)
    idx = (jnp.arange(tokens.shape[1])[None, :] + pad[:, None]) % tokens.shape[1]
    return jnp.take_along_axis(tokens, idx, 1), jnp.take_along_axis(mask, idx, 1)


def prefill(graphdef: nnx.GraphDef, params: Any, prompt_tokens: jax.Array, prompt_mask: jax.Array,
            rows: RowSettings, end_ids: jax.Array, *, samples: int, max_new: int, cap: int,
            head: str = "checked", span_ladder: tuple[int, ...] = (), backend: str = "auto") -> DecodeState:
    """Prompts [P_rows, P] (left-padded, mask True on real tokens) -> state after token 0 of
    each of the P_rows * samples rows, with the cache laid out for `backend`
    (`resolve_backend`). span_ladder: where the CPU backend splits the generated cache into
    blocks (`attention_spans`; ignored by the accelerator path)."""
    backend = resolve_backend(backend)
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    n_prompts, prompt_len = prompt_tokens.shape
    n_rows = n_prompts * samples
    kvh, dh, n_layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    head_w = lm_head_weights(model, head)
    if backend == "accelerator":
        # the whole prompt through the model's fused causal attention (splash on TPU, cuDNN
        # on GPU): no [T, T] score matrix, so 24,576-token prompts fit (see prefill_layout)
        if prefill_layout(model.runtime) == "right":
            prompt_tokens, prompt_mask = right_align(prompt_tokens, prompt_mask)
        hidden, k, v = model.prefill_kv(prompt_tokens, left_pad_positions(prompt_mask), prompt_mask)
        last = jnp.maximum(prompt_mask.sum(-1) - 1, 0) if prefill_layout(model.runtime) == "right" else None
        hidden_last = hidden[:, -1] if last is None else jnp.take_along_axis(hidden, last[:, None, None], 1)[:, 0]
        # the first token from the model's head (a once-per-call cost) unless the rounded
        # "bfloat16" mode was asked for
        logits = _logits(model, hidden_last, head_w)
        # [L, P_rows, S, KVH, Dh] -> [L, P_rows, KVH, S, Dh]
        prompt = PromptCache(k=constrain(k.transpose(0, 1, 3, 2, 4), _PROMPT_KV),
                             v=constrain(v.transpose(0, 1, 3, 2, 4), _PROMPT_KV), valid=prompt_mask)
        gen_shape = (n_layers, n_prompts, kvh, samples, max_new, dh)
        gen_k = constrain(jnp.zeros(gen_shape, k.dtype), _GEN_KV)
        gen_v = constrain(jnp.zeros(gen_shape, v.dtype), _GEN_KV)
    else:
        cache = KVCache.init(cfg, n_prompts, prompt_len, model.runtime.dtype)
        cache = cache.replace(k=constrain(cache.k, _MODEL_KV), v=constrain(cache.v, _MODEL_KV))
        hidden, cache = model(prompt_tokens, left_pad_positions(prompt_mask), attention_mask=prompt_mask, cache=cache)
        # left padding: the last position is real
        logits = _logits(model, hidden[:, -1], head_w)
        k, v = cpu_backend.split_prompt_cache(cache.k, cache.v, n_layers)
        prompt = PromptCache(k=k, v=v, valid=prompt_mask)
        gen_k, gen_v = cpu_backend.generated_blocks(n_layers, n_prompts, kvh, samples, dh,
                                                    attention_spans(max_new, span_ladder), cache.k.dtype)
    state = DecodeState(
        prompt=prompt, gen_k=gen_k, gen_v=gen_v,
        tokens=constrain(jnp.zeros((n_rows, max_new), jnp.int32), _ROWS_STEPS),
        logprobs=constrain(jnp.zeros((n_rows, max_new), jnp.float32), _ROWS_STEPS),
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


def decode(graphdef: nnx.GraphDef, params: Any, state: DecodeState, rows: RowSettings,
           end_ids: jax.Array, checked: CheckedHead | None = None, *, cap: int,
           head: str = "checked", layer_unroll: int | None = None) -> DecodeState:
    """Generate until all rows are done or the token buffer is full (early exit), on the
    backend that laid out `state` (prefill's `backend`).

    Accelerator path: one `while_loop`; each step embeds the fed tokens, runs the layers
    under one `lax.scan` over (stacked layer parameters, prompt cache, generated cache) that
    returns each layer's new key/value, writes those into the generated cache at the step's
    slot (one in-place update of the stacked cache), then picks the next tokens from the
    model's head. Compile time and program size do not grow with depth.
    CPU backend: `cpu_backend.decode_unrolled` (layers unrolled, one phase per cache block).
    checked: the CPU backend's "checked" head (bf16 copy and norms) when the caller keeps it
    between calls (Sampler does, per head-weight array); None builds it inside this call.
    layer_unroll: layers per iteration of the layer scan (1: one layer body in the program;
    the number of layers: no loop, e.g. for the compiler's cost model, which counts a loop
    body once; None: `layer_unroll_for`'s choice for the platform)."""
    model = nnx.merge(graphdef, params)
    backend = state_backend(state)
    choose = token_chooser(model, head, cap=cap, backend=backend, checked=checked)
    record = lambda s, tok, logp, rows: _record(s, tok, logp, rows, end_ids)
    if backend == "cpu":
        return cpu_backend.decode_unrolled(model, state, rows, choose=choose, record=record, step_keys=_step_keys)

    cfg = model.cfg
    dt = jnp.dtype(model.runtime.dtype)
    n_layers, n_prompts, kvh, samples, max_new, dh = state.gen_k.shape
    n_rows = n_prompts * samples
    layer_def, layer_state = nnx.split(model.layers)
    prompt = state.prompt

    def one_token(s: DecodeState) -> DecodeState:
        slot = s.step - 1                      # the fed token (made at step - 1) goes to slot step - 1
        gen_visible = jnp.arange(max_new) < slot
        h = jnp.take(model.embed_tokens[...], s.last[:, None], axis=0).astype(dt)   # [R, 1, D]
        h = constrain(h, ("batch", "length", "act_embed"))
        cos, sin = rope_tables(s.next_pos[:, None], cfg)   # [R, 1, Dh]

        def layer_body(h, xs):
            one_layer, prompt_k, prompt_v, gen_k, gen_v = xs
            layer = nnx.merge(layer_def, one_layer)
            attn = layer.self_attn
            q, k, v = attn.project_qkv(layer.input_layernorm(h), cos, sin)   # [R, 1, heads, Dh]
            # rows (prompt-major) -> [P_rows, KVH, G, ...]: transposes of small per-step arrays only
            q = attn.group_queries(q)[:, 0].reshape(n_prompts, samples, kvh, -1, dh).transpose(0, 2, 1, 3, 4)
            k = k[:, 0].reshape(n_prompts, samples, kvh, dh).transpose(0, 2, 1, 3)
            v = v[:, 0].reshape(n_prompts, samples, kvh, dh).transpose(0, 2, 1, 3)
            out = shared_prompt_step(q, k, v, prompt_k, prompt_v, prompt.valid, gen_k, gen_v, gen_visible, dt)
            h = h + attn.output(out.transpose(0, 2, 1, 3, 4).reshape(n_rows, 1, kvh, -1, dh))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            return constrain(h, ("batch", "length", "act_embed")), (k, v)

        h, (k_new, v_new) = jax.lax.scan(layer_body, h, (layer_state, prompt.k, prompt.v, s.gen_k, s.gen_v),
                                         unroll=layer_unroll_for(layer_unroll, cfg.num_hidden_layers))
        # [L, P_rows, KVH, G, Dh] -> the step's slot of the stacked generated cache, in place
        at = (0, 0, 0, 0, slot, 0)
        gen_k = jax.lax.dynamic_update_slice(s.gen_k, k_new[:, :, :, :, None].astype(s.gen_k.dtype), at)
        gen_v = jax.lax.dynamic_update_slice(s.gen_v, v_new[:, :, :, :, None].astype(s.gen_v.dtype), at)
        tok, logp, fell_back = choose(model.norm(h)[:, 0], _step_keys(rows.keys, s.step), rows, ~s.done)
        s = s.replace(gen_k=constrain(gen_k, _GEN_KV), gen_v=constrain(gen_v, _GEN_KV), next_pos=s.next_pos + 1,
                      head_fallbacks=s.head_fallbacks + fell_back.astype(jnp.int32))
        return _record(s, tok, logp, rows, end_ids)

    return jax.lax.while_loop(lambda s: (s.step < max_new) & ~jnp.all(s.done), one_token, state)


__all__ = ["BACKENDS", "DecodeState", "HEAD_MODES", "PromptCache", "RowSettings", "attention_spans", "decode",
           "prefill", "resolve_backend", "target_platform", "token_chooser", "uses_checked_head"]
