"""Qwen3 dense decoder in Flax NNX: config (shape), runtime options, model, KV cache, HF weights, sharding."""

from actionopd_jax.model.cache import KVCache, left_pad_positions
from actionopd_jax.model.config import PRESETS, Qwen3Config, count_params, flops_per_token
from actionopd_jax.model.qwen3 import Qwen3, init_model
from actionopd_jax.model.runtime import RuntimeOptions
from actionopd_jax.model.sharding import (LOGICAL_AXIS_RULES, cache_shardings, make_mesh,
                                          param_shardings, shard_model)
from actionopd_jax.model.weights import load_hf, save_hf

__all__ = [
    "KVCache", "left_pad_positions", "PRESETS", "Qwen3Config", "count_params", "flops_per_token",
    "Qwen3", "init_model", "RuntimeOptions", "load_hf", "save_hf",
    "LOGICAL_AXIS_RULES", "cache_shardings", "make_mesh", "param_shardings", "shard_model",
]
