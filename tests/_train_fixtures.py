"""Builders shared by the trainer tests: a tiny model, rows, packed minibatches, meshes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from actionopd_jax.model import PRESETS, Qwen3, make_mesh
from actionopd_jax.train.batching import Row, pack_minibatch
from actionopd_jax.train.step import StepSettings, TrainStep, make_optimizer, split_params

TINY = PRESETS["tiny"]


def tiny_params(seed: int = 0, cfg=TINY, runtime=None):
    return split_params(Qwen3(cfg, runtime=runtime, rngs=nnx.Rngs(seed)))


def random_rows(n: int, seed: int, *, vocab: int = TINY.vocab_size, prompt=(3, 20), resp=(1, 9)) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        p = rng.integers(0, vocab, rng.integers(*prompt)).astype(np.int32)
        r = rng.integers(0, vocab, rng.integers(*resp)).astype(np.int32)
        rows.append(Row(p, r, advantage=float(rng.normal()),
                        sampler_logp=-rng.uniform(0.5, 3, len(r)).astype(np.float32),
                        teacher_logp=-rng.uniform(0.5, 3, len(r)).astype(np.float32)))
    return rows


def packed(rows, indices=None, *, microbatches=1, microbatch_rows=None, seq_len=32, resp_len=16):
    indices = list(range(len(rows))) if indices is None else indices
    microbatch_rows = microbatch_rows or len(indices)
    return pack_minibatch(rows, indices, microbatches=microbatches, microbatch_rows=microbatch_rows,
                          seq_len=seq_len, resp_len=resp_len)


def mesh_of(shape: dict[str, int]):
    n = int(np.prod(list(shape.values())))
    return make_mesh(shape, jax.devices()[:n])


def train_step(graphdef, params, shape=None, *, settings=None, lr=1e-2, eps=1e-2, grad_clip=0.0):
    """A TrainStep whose AdamW has a large eps: Adam's per-entry normalisation otherwise turns
    float-rounding differences of near-zero gradients into visible parameter differences, and
    these tests compare computations, not Adam's conditioning."""
    tx = make_optimizer(lr=lr, eps=eps, grad_clip=grad_clip, weight_decay=0.0)
    return TrainStep(graphdef, params, mesh_of(shape or {"data": 1}), tx, settings or StepSettings())


def to_host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def device_params(params):
    return jax.tree.map(jnp.asarray, params)
