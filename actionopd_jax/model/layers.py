"""Qwen3 building blocks: RMSNorm, rotary embeddings, grouped-query attention with q/k-norm, SwiGLU.

Every parameter carries logical axis names in its `out_sharding` metadata (Flax NNX's partition
metadata key); `sharding.LOGICAL_AXIS_RULES` maps those names to mesh axes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import actionopd_jax.model.rope as rope_lib
from actionopd_jax.model.config import Qwen3Config
from actionopd_jax.model.rope import RopeYarn
from actionopd_jax.model.runtime import RuntimeOptions
# the attention functions live in model/attention/; kept importable from here for old callers
from actionopd_jax.model.attention.cpu import causal_attend, causal_blocks  # noqa: F401
from actionopd_jax.model.attention.reference import attend  # noqa: F401

_INIT_STD = 0.02  # HF Qwen3 initializer_range


def _param(rngs: nnx.Rngs, shape, dtype, axes: tuple[str, ...], init=None) -> nnx.Param:
    if init is None:
        value = _INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
    else:
        value = init(shape)
    # Logical names, not mesh axes: placement happens in sharding.shard_model / weights.load_hf,
    # so Flax's eager sharding (which would read them as mesh axes) is off.
    return nnx.Param(value.astype(dtype), out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """y = w * x / sqrt(mean(x^2) + eps), the normalisation computed in float32 (as HF does)."""

    def __init__(self, dim: int, eps: float, *, param_dtype, axis_name: str, rngs: nnx.Rngs):
        self.weight = _param(rngs, (dim,), param_dtype, (axis_name,), init=lambda s: jnp.ones(s))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float,
                 yarn: RopeYarn | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [B, T, head_dim] in float32 for integer positions [B, T]; with YaRN
    the scaled frequencies and both tables times its attention factor (as HF applies it)."""
    angles = positions.astype(jnp.float32)[..., None] * rope_lib.inv_freq(head_dim, theta, yarn)  # [B, T, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if yarn is not None:
        cos, sin = cos * yarn.attention_factor, sin * yarn.attention_factor
    return cos, sin


def rope_tables(positions: jax.Array, cfg: Qwen3Config) -> tuple[jax.Array, jax.Array]:
    """`rope_cos_sin` with the model's RoPE settings (theta and any YaRN scaling)."""
    return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_yarn)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (first half / second half pairing, as in HF Qwen3). x: [B, T, N, Dh]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    def __init__(self, cfg: Qwen3Config, runtime: RuntimeOptions, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        d, h, kv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = _param(rngs, (d, h, dh), pd, ("embed", "heads", "head_dim"))
        self.k_proj = _param(rngs, (d, kv, dh), pd, ("embed", "kv_heads", "head_dim"))
        self.v_proj = _param(rngs, (d, kv, dh), pd, ("embed", "kv_heads", "head_dim"))
        self.o_proj = _param(rngs, (h, dh, d), pd, ("heads", "head_dim", "embed"))
        self.q_norm = RMSNorm(dh, cfg.rms_norm_eps, param_dtype=pd, axis_name="head_dim", rngs=rngs)
        self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, param_dtype=pd, axis_name="head_dim", rngs=rngs)
        self.num_kv_heads = kv
        self.groups = h // kv
        self.rope_theta = cfg.rope_theta
        self.dtype = jnp.dtype(runtime.dtype)

    def project_qkv(self, x, cos, sin, qkv_weight: jax.Array | None = None):
        """q, k, v [B, T, heads, Dh] with q/k-norm and RoPE. qkv_weight: `fused_qkv_weight()`
        built once by a caller that projects many times (decode): one matmul instead of three."""
        dt = self.dtype
        if qkv_weight is None:
            q = dense(x, self.q_proj[...].astype(dt), in_dims=1)
            k = dense(x, self.k_proj[...].astype(dt), in_dims=1)
            v = dense(x, self.v_proj[...].astype(dt), in_dims=1)
        else:
            h, kv = self.num_kv_heads * self.groups, self.num_kv_heads
            qkv = dense_output_major(x, qkv_weight, in_dims=1)
            q, k, v = qkv[..., :h, :], qkv[..., h:h + kv, :], qkv[..., h + kv:, :]
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        return q, k, v

    def fused_qkv_weight(self) -> jax.Array:
        """[heads + 2 kv_heads, Dh, D]: q, k and v projections side by side, output-major
        (`dense_output_major`), compute dtype."""
        w = jnp.concatenate([self.q_proj[...], self.k_proj[...], self.v_proj[...]], axis=1)
        return w.transpose(1, 2, 0).astype(self.dtype)

    def output_major_o_weight(self) -> jax.Array:
        """[D, heads, Dh]: the output projection, output-major, compute dtype."""
        return self.o_proj[...].transpose(2, 0, 1).astype(self.dtype)

    def output(self, attn_out: jax.Array, o_weight: jax.Array | None = None) -> jax.Array:
        """o_weight: `output_major_o_weight()` from a caller that projects many times."""
        b, t = attn_out.shape[:2]
        attn_out = attn_out.reshape(b, t, self.num_kv_heads * self.groups, -1)
        if o_weight is not None:
            return dense_output_major(attn_out, o_weight, in_dims=2)
        return dense(attn_out, self.o_proj[...].astype(self.dtype), in_dims=2)

    def group_queries(self, q: jax.Array) -> jax.Array:
        b, t, _, dh = q.shape
        return q.reshape(b, t, self.num_kv_heads, self.groups, dh)


def _flat_rows(x: jax.Array, in_dims: int) -> tuple[tuple[int, ...], jax.Array]:
    """(leading shape, x as [rows, product of its last `in_dims` axes])."""
    lead, contract = x.shape[: x.ndim - in_dims], x.shape[x.ndim - in_dims:]
    return lead, x.reshape(-1, math.prod(contract))


def dense(x: jax.Array, w: jax.Array, *, in_dims: int) -> jax.Array:
    """Contract the last `in_dims` axes of x with the first `in_dims` axes of w, as ONE 2-D
    matmul over the flattened rows. Same result as the einsum; written this way because CPU
    XLA's weight-gradient matmuls for [batch, time, ...] operands ran ~2.5x slower than for
    [rows, ...] ones in the train step's backward (measured on the trainer benchmark)."""
    lead, rows = _flat_rows(x, in_dims)
    y = rows @ w.reshape(rows.shape[1], -1)
    return y.reshape(*lead, *w.shape[in_dims:])


def dense_output_major(x: jax.Array, w: jax.Array, *, in_dims: int) -> jax.Array:
    """`dense` with the weight stored output-major: w [*out, *in] (the contracted axes last).
    The decode step's weights are kept this way on CPU: with a different weight every
    matmul (streamed from memory, 32 rows), the YNN kernels ran 1.2-1.4x faster on [N, K]
    weights than on [K, N] (measured: 1.23 -> 0.88 ms for 32 x 512 x 3072)."""
    lead, rows = _flat_rows(x, in_dims)
    y = jnp.einsum("rk,nk->rn", rows, w.reshape(-1, rows.shape[1]))
    return y.reshape(*lead, *w.shape[: w.ndim - in_dims])


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Qwen3Config, runtime: RuntimeOptions, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _param(rngs, (d, i), pd, ("embed", "mlp"))
        self.up_proj = _param(rngs, (d, i), pd, ("embed", "mlp"))
        self.down_proj = _param(rngs, (i, d), pd, ("mlp", "embed"))
        self.dtype = jnp.dtype(runtime.dtype)

    def __call__(self, x: jax.Array, gate_up_weight: jax.Array | None = None,
                 down_weight: jax.Array | None = None) -> jax.Array:
        """gate_up_weight / down_weight: `fused_gate_up_weight()` / `output_major_down_weight()`,
        built once by a caller that applies the MLP many times (decode): one matmul for gate
        and up instead of two, output-major weights."""
        dt = self.dtype
        if gate_up_weight is None:
            gate = dense(x, self.gate_proj[...].astype(dt), in_dims=1)
            up = dense(x, self.up_proj[...].astype(dt), in_dims=1)
        else:
            gate_up = dense_output_major(x, gate_up_weight, in_dims=1)
            gate, up = jnp.split(gate_up, 2, axis=-1)
        if down_weight is not None:
            return dense_output_major(jax.nn.silu(gate) * up, down_weight, in_dims=1)
        return dense(jax.nn.silu(gate) * up, self.down_proj[...].astype(dt), in_dims=1)

    def fused_gate_up_weight(self) -> jax.Array:
        """[2 I, D]: gate and up projections side by side, output-major, compute dtype."""
        return jnp.concatenate([self.gate_proj[...], self.up_proj[...]], axis=1).T.astype(self.dtype)

    def output_major_down_weight(self) -> jax.Array:
        """[D, I]: the down projection, output-major, compute dtype."""
        return self.down_proj[...].T.astype(self.dtype)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, runtime: RuntimeOptions, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd,
                                       axis_name="norm", rngs=rngs)
        self.self_attn = Attention(cfg, runtime, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd,
                                                axis_name="norm", rngs=rngs)
        self.mlp = MLP(cfg, runtime, rngs=rngs)
