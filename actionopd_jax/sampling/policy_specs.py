"""What weights a sampler (the static sampler, the paged engine) accepts in `load_policy`: the
leaf-by-leaf record of shapes, dtypes and shardings its compiled programs were specialised on,
set at the first load, and the check of new weights against it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def leaf_specs(params) -> dict[str, tuple]:
    """{leaf path: (shape, dtype, sharding)} of a parameter tree (pure dict or nnx.State)."""
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)  # the same paths for both forms
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): (tuple(x.shape), jnp.dtype(x.dtype), getattr(x, "sharding", None))
            for path, x in leaves}


def config_shapes(cfg) -> dict[str, tuple]:
    """{leaf path: shape} of the parameters a model of `cfg` has (abstract: nothing allocated)."""
    from actionopd_jax.model import Qwen3

    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    return {path: spec[0] for path, spec in leaf_specs(nnx.state(abstract)).items()}


def check_policy(expected: dict[str, tuple], got: dict[str, tuple]) -> None:
    """Raise ValueError naming the first leaf whose path, shape, dtype or sharding differs from
    `expected` (a `leaf_specs` record; a None dtype or sharding there is not checked)."""
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or extra:
        raise ValueError(f"load_policy: the parameters do not match the sampler's model: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    for path, (shape, dtype, sharding) in expected.items():
        g_shape, g_dtype, g_sharding = got[path]
        if g_shape != shape:
            raise ValueError(f"load_policy: parameter {path} has shape {g_shape}, the sampler's model has {shape}")
        if dtype is not None and g_dtype != dtype:
            raise ValueError(f"load_policy: parameter {path} has dtype {g_dtype}, the sampler was built for {dtype}")
        if sharding is not None and g_sharding != sharding:
            raise ValueError(f"load_policy: parameter {path} is placed as {g_sharding}, the sampler was built "
                             f"for {sharding}")


def policy_record(policy: dict[str, tuple] | None, model, cfg, got: dict[str, tuple]) -> dict[str, tuple]:
    """The record weights are checked against: `policy` once set; at the first load the built
    model's (`model`), else `cfg`'s shapes with the loaded weights' (`got`) dtype and sharding."""
    if policy is not None:
        return policy
    if model is not None:
        return leaf_specs(nnx.state(model))
    shapes = config_shapes(cfg)
    return {path: (shapes[path], *got[path][1:]) if path in got else (shape, None, None)
            for path, shape in shapes.items()}
