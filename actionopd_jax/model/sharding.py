"""Logical-axis sharding: parameter/activation axis names -> mesh axes (data, fsdp, tensor).

The table is plain data so that a recipe can swap it (e.g. pure FSDP, or tensor-parallel
sampling).  A mesh axis that does not divide a dimension is dropped for that array (the
dimension is replicated over it) instead of failing: tiny test models have e.g. one KV head.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),
)


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh with Auto axes in canonical order (data, fsdp, tensor); axes not named get no axis.

    One size may be -1: it takes the devices left over.  Without `devices`, the first
    prod(shape) devices of `jax.devices()` are used.
    """
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; use a subset of {MESH_AXES}")
    if not shape:
        raise ValueError(f"mesh shape is empty; give sizes for some of {MESH_AXES}")
    names = tuple(a for a in MESH_AXES if a in shape)
    sizes = [int(shape[a]) for a in names]
    pool = list(devices) if devices is not None else jax.devices()
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {shape}")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if len(pool) % known:
            raise ValueError(f"{len(pool)} devices cannot be split by the fixed axes of {shape}")
        sizes[sizes.index(-1)] = len(pool) // known
    if any(s <= 0 for s in sizes):
        raise ValueError(f"mesh axis sizes must be positive (or one -1), got {shape}")
    need = math.prod(sizes)
    if devices is not None and need != len(pool):
        raise ValueError(f"mesh {dict(zip(names, sizes))} needs {need} devices, {len(pool)} were given")
    if need > len(pool):
        raise ValueError(f"mesh {dict(zip(names, sizes))} needs {need} devices, only {len(pool)} exist")
    return jax.make_mesh(tuple(sizes), names, axis_types=(AxisType.Auto,) * len(names),
                         devices=pool[:need])


def logical_to_spec(logical_axes: Sequence[str | None] | None, mesh, rules: Rules = LOGICAL_AXIS_RULES,
                    shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose dims carry `logical_axes` names.

    Mesh axes absent from `mesh`, of size 1, already used by an earlier dim, or not dividing
    the dim (when `shape` is given) are left out.
    """
    if not logical_axes:
        return PartitionSpec()
    table = dict(rules)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    used: set[str] = set()
    spec: list[Any] = []
    for dim, name in enumerate(logical_axes):
        target = table.get(name) if name is not None else None
        if name is not None and name not in table:
            raise KeyError(f"logical axis {name!r} has no entry in the sharding rules {sorted(table)}")
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        chosen: list[str] = []
        for a in axes:
            if a not in sizes or sizes[a] == 1 or a in used:
                continue
            if shape is not None and shape[dim] % (math.prod(sizes[c] for c in chosen) * sizes[a]):
                continue
            chosen.append(a)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(model_or_state, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES):
    """NamedShardings for every Variable (same tree structure as `nnx.state(model)`).

    Accepts a module, or a state whose Variables hold arrays or ShapeDtypeStructs.
    """
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state

    def one(var):
        axes = var.get_metadata().get("out_sharding")
        return var.replace(NamedSharding(mesh, logical_to_spec(axes, mesh, rules, var.shape)))

    return jax.tree.map(one, state, is_leaf=_is_var)


def shard_model(model, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES):
    """Move every parameter of `model` to its sharding on `mesh` (in place); returns the model."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh, rules)))
    return model


def cache_shardings(cache, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES):
    """NamedShardings for a KVCache (rows over data/fsdp, KV heads over tensor), same structure."""
    kv_axes = ("layers", "batch", "length", "kv_heads", "head_dim")

    def named(axes, shape):
        return NamedSharding(mesh, logical_to_spec(axes, mesh, rules, shape))

    return type(cache)(k=named(kv_axes, cache.k.shape), v=named(kv_axes, cache.v.shape),
                       valid=named(("batch", "length"), cache.valid.shape), index=named((), ()))


def constrain(x: jax.Array, logical_axes: Sequence[str | None],
              rules: Rules = LOGICAL_AXIS_RULES) -> jax.Array:
    """Sharding hint for an activation under the ambient mesh (`jax.set_mesh`); no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(logical_axes, mesh, rules, x.shape)
    if all(s is None for s in spec):
        return x
    return jax.lax.with_sharding_constraint(x, spec)
