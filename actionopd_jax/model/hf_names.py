"""Correspondence between our stacked NNX parameters and Hugging Face Qwen3 tensor names/layouts.

HF stores linear weights as [out, in]; we store [in, ...] with heads split out, so that each
dimension has one logical axis name.  Each tensor has a `kind` telling how the two relate:
  copy       same array (embedding [V, D], lm_head [V, D], norm scales)
  t          transpose ([out, in] <-> [in, out]): MLP projections
  split_out  q/k/v: HF [n*d, in] <-> ours [in, n, d]
  split_in   o_proj: HF [out, n*d] <-> ours [n, d, out]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from actionopd_jax.model.config import Qwen3Config


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    hf_name: str
    path: tuple[str, ...]  # path in nnx.state(model)
    layer: int | None  # index on the stacked layer axis, None for unstacked params
    kind: str
    hf_shape: tuple[int, ...]
    our_shape: tuple[int, ...]  # per-layer shape (without the layer axis)


def tensor_specs(cfg: Qwen3Config) -> list[TensorSpec]:
    """All HF tensors of a checkpoint for `cfg`, grouped by parameter (all layers of one param together)."""
    d, i, h, kv, dh, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                          cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)
    per_layer = [
        # (our path, hf suffix, kind, hf shape, our per-layer shape)
        (("self_attn", "q_proj"), "self_attn.q_proj.weight", "split_out", (h * dh, d), (d, h, dh)),
        (("self_attn", "k_proj"), "self_attn.k_proj.weight", "split_out", (kv * dh, d), (d, kv, dh)),
        (("self_attn", "v_proj"), "self_attn.v_proj.weight", "split_out", (kv * dh, d), (d, kv, dh)),
        (("self_attn", "o_proj"), "self_attn.o_proj.weight", "split_in", (d, h * dh), (h, dh, d)),
        (("self_attn", "q_norm", "weight"), "self_attn.q_norm.weight", "copy", (dh,), (dh,)),
        (("self_attn", "k_norm", "weight"), "self_attn.k_norm.weight", "copy", (dh,), (dh,)),
        (("input_layernorm", "weight"), "input_layernorm.weight", "copy", (d,), (d,)),
        (("post_attention_layernorm", "weight"), "post_attention_layernorm.weight", "copy", (d,), (d,)),
        (("mlp", "gate_proj"), "mlp.gate_proj.weight", "t", (i, d), (d, i)),
        (("mlp", "up_proj"), "mlp.up_proj.weight", "t", (i, d), (d, i)),
        (("mlp", "down_proj"), "mlp.down_proj.weight", "t", (d, i), (i, d)),
    ]
    specs = [TensorSpec("model.embed_tokens.weight", ("embed_tokens",), None, "copy", (v, d), (v, d))]
    for path, suffix, kind, hf_shape, our_shape in per_layer:
        for layer in range(cfg.num_hidden_layers):
            specs.append(TensorSpec(f"model.layers.{layer}.{suffix}", ("layers",) + path, layer, kind,
                                    hf_shape, our_shape))
    specs.append(TensorSpec("model.norm.weight", ("norm", "weight"), None, "copy", (d,), (d,)))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", ("lm_head",), None, "copy", (v, d), (v, d)))
    return specs


def to_hf(ours: np.ndarray, kind: str) -> np.ndarray:
    """Our per-layer array -> HF layout (contiguous)."""
    if kind == "copy":
        return np.ascontiguousarray(ours)
    if kind == "t":
        return np.ascontiguousarray(ours.T)
    if kind == "split_out":
        return np.ascontiguousarray(ours.reshape(ours.shape[0], -1).T)
    if kind == "split_in":
        return np.ascontiguousarray(ours.reshape(-1, ours.shape[-1]).T)
    raise ValueError(f"unknown tensor kind {kind!r}")


def read_our_slice(hf_slice, kind: str, our_shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """Read only the part of an HF tensor needed for `index` (slices over our per-layer dims).

    `hf_slice` supports numpy-style slicing of the stored HF tensor (safetensors' get_slice).
    """
    idx = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, our_shape))
    if kind == "copy":
        return hf_slice[idx] if idx else hf_slice[:]
    if kind == "t":
        a, b = idx
        return hf_slice[b, a].T
    if kind == "split_out":  # ours [in, n, d] from HF [n*d, in]
        in_s, n_s, d_s = idx
        d = our_shape[2]
        rows = hf_slice[n_s.start * d:n_s.stop * d, in_s]  # [n_len*d, in_len]
        return rows.T.reshape(in_s.stop - in_s.start, n_s.stop - n_s.start, d)[:, :, d_s]
    if kind == "split_in":  # ours [n, d, out] from HF [out, n*d]
        n_s, d_s, out_s = idx
        d = our_shape[1]
        cols = hf_slice[out_s, n_s.start * d:n_s.stop * d]  # [out_len, n_len*d]
        return cols.T.reshape(n_s.stop - n_s.start, d, out_s.stop - out_s.start)[:, d_s, :]
    raise ValueError(f"unknown tensor kind {kind!r}")
