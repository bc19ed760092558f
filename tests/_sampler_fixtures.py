"""Tiny random models and a teacher-forcing reference for the sampler tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from actionopd_jax.model import Qwen3
from actionopd_jax.model.runtime import RuntimeOptions
from actionopd_jax.testing.tiny_checkpoint import tiny_config

REF_LEN = 128  # reference forwards are right-padded to this length: one compiled program


def random_model(seed: int, *, std: float = 0.1, **overrides) -> Qwen3:
    """A tiny Qwen3 whose weights are large enough (std 0.1, not HF's 0.02) that greedy
    continuations vary from step to step instead of repeating one token. `dtype` sets the
    parameter and compute dtypes."""
    cfg = tiny_config(**overrides)
    runtime = RuntimeOptions(dtype=overrides.get("dtype", "float32"))
    model = Qwen3(cfg, runtime=runtime, rngs=nnx.Rngs(params=seed))
    params = nnx.state(model, nnx.Param)
    key = jax.random.key(seed)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    leaves = [x if x.ndim < 2 else std * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


@nnx.jit
def _full_logits(model, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = model(tokens, positions)
    return model.logits(hidden)


def next_token_logits(model, prompt: np.ndarray, generated: np.ndarray) -> np.ndarray:
    """Logits [len(generated), V] that a full (cache-free) causal forward over
    prompt + generated assigns to each generated position: row t predicts generated[t] from
    prompt + generated[:t]. Right padding cannot affect earlier positions of a causal model."""
    seq = np.concatenate([prompt, generated]).astype(np.int32)
    assert seq.size <= REF_LEN
    padded = np.zeros((1, REF_LEN), np.int32)
    padded[0, :seq.size] = seq
    logits = np.asarray(_full_logits(model, padded))[0]
    return logits[prompt.size - 1: seq.size - 1]
