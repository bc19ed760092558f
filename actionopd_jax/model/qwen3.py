"""Qwen3 dense decoder (Flax NNX) with layers stacked on a leading axis and run under a scan.

Parameters of all layers live in one stacked module (created with `nnx.vmap`), so the traced
program holds one layer body whatever the depth and compile time stays flat.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from actionopd_jax.model.cache import KVCache
from actionopd_jax.model.config import Qwen3Config
from actionopd_jax.model.attention.dispatch import causal_self_attention
from actionopd_jax.model.attention.names import ATTENTION_OUT
from actionopd_jax.model.attention.reference import attend
from actionopd_jax.model.attention.shared_prefix import SharedPrefix
from actionopd_jax.model.runtime import RuntimeOptions
from actionopd_jax.model.layers import DecoderLayer, RMSNorm, _param, rope_tables
from actionopd_jax.model.sharding import constrain

_ACT = ("batch", "length", "act_embed")
_KV = ("batch", "length", "kv_heads", "head_dim")

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # keep the weight matmuls (no batch dims), recompute attention and elementwise work
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # keep what the attention backward needs (splash: its output and log-sum-exp), recompute the
    # rest: the backward never reruns the attention forward, the costliest part of a long row
    "attn": jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT),
    # the same, kept in host memory instead of HBM (TPU/GPU pinned host memory)
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(ATTENTION_OUT,),
        offload_src="device", offload_dst="pinned_host"),
}


class Qwen3(nnx.Module):
    """cfg: the architecture; runtime: how it runs (compute dtype, remat, attention kernel,
    scan unroll; default RuntimeOptions())."""

    def __init__(self, cfg: Qwen3Config, *, runtime: RuntimeOptions | None = None, rngs: nnx.Rngs):
        self.cfg = cfg
        self.runtime = runtime = RuntimeOptions() if runtime is None else runtime
        pd = jnp.dtype(cfg.param_dtype)
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), pd, ("vocab", "embed"))

        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(r: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, runtime, rngs=r)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, axis_name="norm", rngs=rngs)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            # stored [V, D] like the embedding (and like HF's lm_head.weight)
            self.lm_head = _param(rngs, (cfg.vocab_size, cfg.hidden_size), pd, ("vocab", "embed"))

    # ------------------------------------------------------------------------------------
    def __call__(self, tokens: jax.Array, positions: jax.Array, *,
                 attention_mask: jax.Array | None = None,
                 cache: KVCache | None = None,
                 shared_prefix: SharedPrefix | None = None) -> tuple[jax.Array, KVCache | None]:
        """Final-RMSNormed hidden states [B, T, D] (compute dtype) and the updated cache.

        Without cache: causal attention within the T tokens; keys whose attention_mask is
        False are excluded.  With cache: the T new keys/values go to slots
        [cache.index, cache.index + T), `valid` there is set from attention_mask, each token
        attends to every valid slot at or before its own; the returned cache has index + T.
        shared_prefix (no cache): the rows are packed [prompt | N responses] (attention.SharedPrefix);
        positions then restart after the prompt in every response region.
        """
        cfg, rt = self.cfg, self.runtime
        dt = jnp.dtype(rt.dtype)
        b, t = tokens.shape
        if positions.shape != tokens.shape:
            raise ValueError(f"positions {positions.shape} must match tokens {tokens.shape}")
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), bool)
        attention_mask = attention_mask.astype(bool)

        h = jnp.take(self.embed_tokens[...], tokens, axis=0).astype(dt)
        h = constrain(h, _ACT)
        cos, sin = rope_tables(positions, cfg)
        graphdef, layer_state = nnx.split(self.layers)

        if cache is None:
            h, _ = self._causal_layers(h, cos, sin, attention_mask, graphdef, layer_state, keep_kv=False,
                                       shared_prefix=shared_prefix)
            return self.norm(h), None

        if cache.k.shape[:2] != (cfg.num_hidden_layers, b):
            raise ValueError(f"cache holds {cache.k.shape[:2]} (layers, batch); model/tokens need "
                             f"({cfg.num_hidden_layers}, {b})")
        start = cache.index
        slots = cache.k.shape[2]
        valid = jax.lax.dynamic_update_slice(cache.valid, attention_mask, (0, start))
        query_slot = start + jnp.arange(t)
        mask = valid[:, None, :] & (jnp.arange(slots)[None, None, :] <= query_slot[None, :, None])

        def cached_body(carry, xs):
            h, k_all, v_all = carry
            one_layer, i = xs
            layer = nnx.merge(graphdef, one_layer)
            attn = layer.self_attn
            q, k, v = attn.project_qkv(layer.input_layernorm(h), cos, sin)
            # Write in place into the carried full cache (no per-step copy of other slots).
            k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), (i, 0, start, 0, 0))
            v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), (i, 0, start, 0, 0))
            k_layer = jax.lax.dynamic_index_in_dim(k_all, i, keepdims=False)
            v_layer = jax.lax.dynamic_index_in_dim(v_all, i, keepdims=False)
            out = attend(attn.group_queries(q), k_layer.astype(dt), v_layer, mask, dt)
            return (self._finish_block(layer, h, out), k_all, v_all), None

        layer_ids = jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)
        (h, k_all, v_all), _ = jax.lax.scan(cached_body, (h, cache.k, cache.v), (layer_state, layer_ids),
                                            unroll=rt.layers_per_scan_step(cfg.num_hidden_layers))
        new_cache = KVCache(k=k_all, v=v_all, valid=valid, index=(start + t).astype(jnp.int32))
        return self.norm(h), new_cache

    def prefill_kv(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(final-normed hidden [B, T, D], keys, values [L, B, T, KVH, Dh] in compute dtype) of a
        whole prompt through the fused causal attention (`runtime.attention`): a prompt of any
        length never materialises a [T, T] score matrix (the cached forward does)."""
        dt = jnp.dtype(self.runtime.dtype)
        h = constrain(jnp.take(self.embed_tokens[...], tokens, axis=0).astype(dt), _ACT)
        cos, sin = rope_tables(positions, self.cfg)
        graphdef, layer_state = nnx.split(self.layers)
        h, (k, v) = self._causal_layers(h, cos, sin, attention_mask.astype(bool), graphdef, layer_state,
                                        keep_kv=True)
        return self.norm(h), k, v

    def _causal_layers(self, h, cos, sin, attention_mask, graphdef, layer_state, *, keep_kv: bool,
                       shared_prefix: SharedPrefix | None = None):
        """The layer scan of a cache-free forward; keep_kv also returns every layer's k/v."""
        cfg, rt = self.cfg, self.runtime
        dt = jnp.dtype(rt.dtype)

        def body(h, one_layer):
            layer = nnx.merge(graphdef, one_layer)
            attn = layer.self_attn
            q, k, v = attn.project_qkv(layer.input_layernorm(h), cos, sin)
            out = causal_self_attention(attn.group_queries(q), k, v, attention_mask, dt, rt.attention,
                                        shared_prefix)
            kv = (constrain(k, _KV), constrain(v, _KV)) if keep_kv else None
            return self._finish_block(layer, h, out), kv

        if rt.remat != "none" and not keep_kv:
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[rt.remat])
        return jax.lax.scan(body, h, layer_state, unroll=rt.layers_per_scan_step(cfg.num_hidden_layers))

    @staticmethod
    def _finish_block(layer: DecoderLayer, h: jax.Array, attn_out: jax.Array) -> jax.Array:
        h = h + layer.self_attn.output(attn_out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return constrain(h, _ACT)

    def head_weight(self) -> jax.Array:
        """The LM head [V, D]: the tied embedding or the separate lm_head."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head)[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """LM head in float32 accumulation; call it only on positions that need logits."""
        w = self.head_weight()
        return jnp.einsum("...d,vd->...v", hidden.astype(w.dtype), w, preferred_element_type=jnp.float32)


def init_model(cfg: Qwen3Config, key: jax.Array, *, runtime: RuntimeOptions | None = None,
               mesh: jax.sharding.Mesh | None = None, rules=None) -> Qwen3:
    """Randomly initialised model built by one compiled program (fast for large shapes).

    With a mesh, every parameter is created directly in its sharding (no full copy on one device).
    """
    from actionopd_jax.model.sharding import LOGICAL_AXIS_RULES, param_shardings

    def make():
        return Qwen3(cfg, runtime=runtime, rngs=nnx.Rngs(params=key))

    graphdef, abs_state = nnx.split(nnx.eval_shape(make))
    out = None if mesh is None else param_shardings(abs_state, mesh, rules or LOGICAL_AXIS_RULES)
    state = jax.jit(lambda: nnx.state(make()), out_shardings=out)()
    return nnx.merge(graphdef, state)
