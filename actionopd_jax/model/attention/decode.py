"""Decode-time attention: one new token per row against a KV cache, shared prompt caches.

- `attend` (reference.py) is the model's cached forward (`Qwen3.__call__` with a KVCache);
- `shared_prompt_step`: the accelerator decode step's attention (sampling/decode.py) over
  [own prompt | own generated | itself], the stacked cache's layout;
- `shared_prompt_blocks`: the CPU backend's (sampling/cpu_backend.py), the prompt's keys
  transposed and the generated cache in blocks.
The G samples of a prompt share its prompt cache: their queries are the rows of one
contraction against it. Scores and softmax in float32, as the model's attention.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from actionopd_jax.model.attention.reference import MASK_VALUE

_MASKED = MASK_VALUE  # finite: a fully masked row stays NaN-free


def shared_prompt_step(q, k_new, v_new, prompt_k, prompt_v, prompt_valid, gen_k, gen_v, gen_visible, dtype):
    """One decode step's attention for one layer over [own prompt | own generated | itself].

    q [P_rows, KVH, G, Gq, Dh] (Gq = query heads per KV head); k_new/v_new [P_rows, KVH, G, Dh]:
    the fed token's own key/value (not yet in the cache); prompt_k/v [P_rows, KVH, S, Dh],
    shared by the G samples of a prompt (their queries are the rows of one contraction
    against it); prompt_valid bool[P_rows, S]; gen_k/v [P_rows, KVH, G, N, Dh] with
    gen_visible bool[N] (the slots written by earlier steps). Scores and softmax in float32
    (as the model's attention). Returns [P_rows, KVH, G, Gq, Dh] in `dtype`."""
    scale = q.shape[-1] ** -0.5
    f32 = jnp.float32
    s_prompt = jnp.einsum("pkghd,pksd->pkghs", q, prompt_k.astype(dtype), preferred_element_type=f32) * scale
    s_prompt = jnp.where(prompt_valid[:, None, None, None, :], s_prompt, _MASKED)
    s_gen = jnp.einsum("pkghd,pkgnd->pkghn", q, gen_k.astype(dtype), preferred_element_type=f32) * scale
    s_gen = jnp.where(gen_visible, s_gen, _MASKED)
    s_self = jnp.einsum("pkghd,pkgd->pkgh", q, k_new.astype(dtype), preferred_element_type=f32)[..., None] * scale
    top = jnp.maximum(jnp.maximum(s_prompt.max(-1, keepdims=True), s_gen.max(-1, keepdims=True)), s_self)
    e_prompt, e_gen, e_self = jnp.exp(s_prompt - top), jnp.exp(s_gen - top), jnp.exp(s_self - top)
    denom = e_prompt.sum(-1, keepdims=True) + e_gen.sum(-1, keepdims=True) + e_self
    out = jnp.einsum("pkghs,pksd->pkghd", (e_prompt / denom).astype(dtype), prompt_v.astype(dtype))
    out = out + jnp.einsum("pkghn,pkgnd->pkghd", (e_gen / denom).astype(dtype), gen_v.astype(dtype))
    return out + (e_self / denom).astype(dtype) * v_new.astype(dtype)[:, :, :, None, :]


def shared_prompt_blocks(q, prompt_k, prompt_v, prompt_valid, gen_blocks, last_visible, dtype):
    """Softmax attention of decode queries over [own prompt slots | own generated slots].

    q: [P_rows, KVH, G, Gq, Dh] (Gq = query heads per KV head); prompt_k: [P_rows, KVH, Dh, P];
    prompt_v: [P_rows, KVH, P, Dh]; prompt_valid: bool[P_rows, P]; gen_blocks: the generated
    cache's blocks in slot order, pairs (keys [P_rows, KVH, G, Dh, n], values
    [P_rows, KVH, G, n, Dh]), every slot visible except in the last block, where
    last_visible bool[n_last] says which are. The G samples' queries of a prompt are the rows
    of one matmul against its shared prompt cache. Scores and softmax in float32 (as the
    model's attention). Returns [P_rows, KVH, G, Gq, Dh]. (Measured on CPU XLA: with values
    contracted over a non-minor axis, the prompt's probs @ values ran as a generic ~1.5 ms
    dot per layer per step.)
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
