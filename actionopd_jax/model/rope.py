"""Rotary position embedding settings as a HF config.json states them, read the way
transformers (5.x, checked against 5.24) reads them, and YaRN's frequency table.

Reading order (transformers' `convert_rope_params_to_dict` / `standardize_rope_params`):
a non-empty `rope_scaling` replaces `rope_parameters` entirely; `rope_theta` comes from that
dict, else the top-level `rope_theta`, else 10000; the type is its `rope_type` (or legacy
`type`), default "default". For YaRN, a top-level `original_max_position_embeddings` wins over
the dict's, which defaults to `max_position_embeddings`. Anything else is refused, never
approximated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

DEFAULT_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


@dataclasses.dataclass(frozen=True)
class RopeYarn:
    """YaRN (arXiv 2309.00071), every value resolved: frequencies blend interpolation (/factor)
    and extrapolation over a ramp between the beta_fast/beta_slow correction dimensions, and
    cos/sin are multiplied by attention_factor."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def to_hf(self, theta: float) -> dict[str, Any]:
        return {"rope_type": "yarn", "rope_theta": theta, "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "attention_factor": self.attention_factor, "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow, "truncate": self.truncate}


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _number(rope: dict, key: str, what: str) -> float:
    value = rope[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"unsupported Qwen3 config: {what} {key}={value!r} must be a positive number")
    return float(value)


def rope_from_hf(d: dict[str, Any], max_position_embeddings: int) -> tuple[float, RopeYarn | None]:
    """(theta, YaRN settings or None) of a HF config dict; ValueError for what is not supported."""
    scaling, params = d.get("rope_scaling"), d.get("rope_parameters")
    rope = scaling or params or {}
    source = "rope_scaling" if scaling else "rope_parameters"
    if not isinstance(rope, dict):
        raise ValueError(f"unsupported Qwen3 config: {source} must be an object, got {rope!r}")
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"unsupported Qwen3 config: {source} nested per layer type (one RoPE for all layers only)")
    theta = rope.get("rope_theta")
    if theta is None:
        theta = d.get("rope_theta")
    theta = DEFAULT_THETA if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
        raise ValueError(f"unsupported Qwen3 config: rope_theta={theta!r} must be a number > 1")
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"unsupported Qwen3 config: partial_rotary_factor={partial!r} (Qwen3 rotates the whole head)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "yarn":
        raise ValueError(f"unsupported Qwen3 config: {source} rope type {rope_type!r} "
                         "(default RoPE and YaRN are implemented)")
    original = d.get("original_max_position_embeddings", rope.get("original_max_position_embeddings",
                                                                    max_position_embeddings))
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ValueError(f"unsupported Qwen3 config: YaRN original_max_position_embeddings={original!r} "
                         "must be a positive integer")
    if "factor" not in rope:
        raise ValueError(f"unsupported Qwen3 config: YaRN {source} has no 'factor' (transformers requires it)")
    factor = (max_position_embeddings / original if rope["factor"] is None
              else _number(rope, "factor", "YaRN"))
    if rope.get("attention_factor") is not None:
        attention_factor = _number(rope, "attention_factor", "YaRN")
    elif rope.get("mscale") and rope.get("mscale_all_dim"):
        attention_factor = _mscale(factor, float(rope["mscale"])) / _mscale(factor, float(rope["mscale_all_dim"]))
    else:
        attention_factor = _mscale(factor)
    beta_fast = float(rope.get("beta_fast") or 32)  # `or`: transformers treats 0 / null as unset
    beta_slow = float(rope.get("beta_slow") or 1)
    return float(theta), RopeYarn(factor=float(factor), original_max_position_embeddings=int(original),
                                  attention_factor=float(attention_factor), beta_fast=beta_fast,
                                  beta_slow=beta_slow, truncate=bool(rope.get("truncate", True)))


def inv_freq(head_dim: int, theta: float, yarn: RopeYarn | None = None) -> jax.Array:
    """float32[head_dim / 2] rotation frequencies, in float32 arithmetic as HF computes them."""
    pos_freqs = theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    extrapolated = 1.0 / pos_freqs
    if yarn is None:
        return extrapolated
    interpolated = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength fits `rotations` times into the original context
        return head_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (high-frequency dims), 0: interpolate (/factor)
    return interpolated * (1.0 - keep) + extrapolated * keep
