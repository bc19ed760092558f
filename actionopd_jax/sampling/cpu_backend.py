"""The sampler's CPU backend: the fast paths that only pay off on CPU XLA.

`decode.py` describes the plain (accelerator) path: layers under `lax.scan` over stacked
parameters and a stacked KV cache, one attention phase, the model's own LM head. On a CPU
target (`decode.resolve_backend`), prefill and decode switch to this module instead:

- **layers unrolled in Python**, each layer's weights sliced once per call, with **fused,
  output-major step weights** (q/k/v and gate/up side by side, every weight [N, K]): two
  matmuls per layer per step instead of five, and YNN's kernels run [N, K] weights
  1.2-1.4x faster (`step_weights`);
- **split generated-cache blocks** (`attention_spans`): one `while_loop` phase per block, so
  attention over generated tokens reads what has been made so far, not the whole buffer;
  blocks are separate arrays because a slice of one buffer is a copy on CPU XLA;
- **per-layer cache arrays in matmul-canonical layouts**: keys transposed ([.., Dh, slots]),
  values [.., slots, Dh], (prompt, KV head) batch axes leading;
- **the "checked" bf16 LM head** (checked_head.py, vocabulary-major logits) for a float32
  head: the float32 model's tokens at about a third of the head's cost;
- **XLA CPU compiler options** (`compiler_options`).

Every path here gives the same tokens as the plain path (tests/test_sampler_model.py checks
both against full forwards and against each other).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from actionopd_jax.model.attention.decode import shared_prompt_blocks
from actionopd_jax.model.layers import rope_tables
from actionopd_jax.sampling.checked_head import CheckedHead, checked_head, choose_tokens_checked



# --- LM head ---------------------------------------------------------------------------------
def uses_checked_head(head_weight: jax.Array, head: str) -> bool:
    """Whether the "checked" head runs (the CPU backend only; the caller checks that): it
    needs a float32 head, since its error bound assumes true float32 matmuls and a bf16
    model's head is already bf16."""
    return head == "checked" and head_weight.dtype == jnp.float32


def checked_chooser(model, checked: CheckedHead | None, *, cap: int):
    """The "checked" head's step function (decode.token_chooser's contract)."""
    if checked is None:
        checked = checked_head(model.head_weight())  # loop-invariant: built once per call

    def choose(hidden, keys, rows, active):
        return choose_tokens_checked(checked, model.head_weight(), hidden, model.logits, keys,
                                     rows.temperature, rows.top_k, rows.top_p, cap=cap, active=active)
    return choose


@functools.cache
def compiler_options(kind: str) -> tuple[tuple[str, object], ...]:
    """XLA CPU options for the sampler's programs (kind: "prefill" | "decode").
    - on AVX-512 CPUs, 512-bit vectors (XLA's CPU default is 256): the decode step's
      vocabulary-wide exp-sum and maxima are vector-bound; decode 1270 -> 1385 tok/s on
      bench-tiny (2-core Xeon);
    - decode only: dots alone go to the YNN library, one per call (by default it also takes
      fused element-wise/reduction subgraphs; XLA's own loops run the decode step's exp-sum
      ~1.5x faster): decode +6-10% on bench-tiny/small. Prefill keeps the default (its
      fused subgraphs are faster in YNN: 0.28 s vs 0.44 s on bench-tiny)."""
    options = {}
    try:
        with open("/proc/cpuinfo") as f:
            if " avx512f" in f.read():
                options["xla_cpu_prefer_vector_width"] = 512
    except OSError:
        pass
    if kind == "decode":
        options["xla_cpu_experimental_ynn_fusion_type"] = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
    return tuple(options.items())


# --- layer weights -----------------------------------------------------------------------------
def step_weights(layer) -> tuple:
    """(qkv, o, gate_up, down) weights for a layer's decode steps, built once per call:
    q/k/v and gate/up side by side (two matmuls per layer per step instead of five; each
    small matmul costs ~0.1 ms of fixed overhead on CPU), every weight [N, K]
    (layers.dense_output_major: YNN streams those 1.2-1.4x faster). They cost as much memory
    again as the layer weights, which is why accelerators do not use them."""
    return (layer.self_attn.fused_qkv_weight(), layer.self_attn.output_major_o_weight(),
            layer.mlp.fused_gate_up_weight(), layer.mlp.output_major_down_weight())


# --- cache layout ------------------------------------------------------------------------------
def split_prompt_cache(cache_k: jax.Array, cache_v: jax.Array, n_layers: int) -> tuple[tuple, tuple]:
    """The model's stacked cache [L, P_rows, S, KVH, Dh] -> per layer keys [P_rows, KVH, Dh, S]
    (transposed) and values [P_rows, KVH, S, Dh]."""
    layers = range(n_layers)
    return (tuple(cache_k[i].transpose(0, 2, 3, 1) for i in layers),
            tuple(cache_v[i].transpose(0, 2, 1, 3) for i in layers))


def generated_blocks(n_layers: int, n_prompts: int, kvh: int, samples: int, dh: int, block_ends, dtype):
    """Empty generated cache: per layer a tuple of blocks, keys (transposed)
    [P_rows, KVH, G, Dh, n_j], values [P_rows, KVH, G, n_j, Dh]; the blocks' n_j sum to N."""
    sizes = [end - start for start, end in zip((0,) + tuple(block_ends[:-1]), block_ends)]
    gen_k = tuple(tuple(jnp.zeros((n_prompts, kvh, samples, dh, n), dtype) for n in sizes) for _ in range(n_layers))
    gen_v = tuple(tuple(jnp.zeros((n_prompts, kvh, samples, n, dh), dtype) for n in sizes) for _ in range(n_layers))
    return gen_k, gen_v


# --- decode ------------------------------------------------------------------------------------
def decode_unrolled(model, state, rows, *, choose, record, step_keys):
    """decode.decode on the CPU backend: generate until all rows are done or the buffer is
    full, one `while_loop` phase per generated-cache block.

    Phase j writes block j and attends over blocks 0..j only, so attention over generated
    tokens costs what the tokens made so far need, not what the buffer holds (a 4096-slot
    buffer with 100-token replies reads 128 slots per step). Blocks are separate arrays
    because a slice of one buffer is a copy on CPU XLA (measured: +9 ms per step on
    bench-small). Each phase is one more copy of the loop body in the program (compile
    time), which is why accelerators run one phase over stacked layers instead."""
    cfg = model.cfg
    dt = jnp.dtype(model.runtime.dtype)
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
    # RoPE cos/sin of every position this call can reach, computed once: computed per step,
    # XLA fused them into each layer's q and k fusions and evaluated them per element there
    cos_table, sin_table = (t[0] for t in rope_tables(jnp.arange(prompt.valid.shape[-1] + max_new)[None],
                                                      cfg))   # [positions, Dh]

    def one_token(s, block: int):
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
            out = shared_prompt_blocks(qg, prompt.k[i], prompt.v[i], prompt.valid,
                                           list(zip(gen_k[i], gen_v[i]))[:block + 1], visible, dt)
            out = out.transpose(0, 2, 1, 3, 4).reshape(n_rows, 1, kvh, *out.shape[3:])   # [R, 1, KVH, Gq, Dh]
            h = h + attn.output(out, o_w)
            h = h + layer.mlp(layer.post_attention_layernorm(h), gate_up_w, down_w)
        tok, logp, fell_back = choose(model.norm(h)[:, 0], step_keys(rows.keys, s.step), rows, ~s.done)
        s = s.replace(gen_k=tuple(tuple(b) for b in gen_k), gen_v=tuple(tuple(b) for b in gen_v),
                      next_pos=s.next_pos + 1, head_fallbacks=s.head_fallbacks + fell_back.astype(jnp.int32))
        return record(s, tok, logp, rows)

    for block, end in enumerate(block_ends):
        # step t feeds slot t - 1: this block serves steps up to `end`
        state = jax.lax.while_loop(lambda s, end=end: (s.step < max_new) & (s.step <= end) & ~jnp.all(s.done),
                                   functools.partial(one_token, block=block), state)
    return state
