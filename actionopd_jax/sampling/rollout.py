"""The sampler's rollout copy of a training step's policy, and loading it into a Sampler.

Per step, the behaviour snapshot (policy.params, on the training mesh and donated to the
update that follows collection) is put where this process can sample with it: bf16 on
accelerators, resharded on device (one jitted identity with out_shardings, never through
host memory) tensor-parallel over this process's local devices and replicated over
processes; on a single CPU process the training placement as it is. With several processes
that reshard is the only cross-process operation: every source calls it at the same point
of every process's step, before collection starts.

A recipe may split one host's devices (mesh.rollout_devices = k, train/setup.rollout_devices):
the trainer's mesh holds the first D - k, the copy goes to a "tensor" mesh over the last k.
jit cannot write to devices its inputs are not on, so the one jitted program (cast + layout)
writes the copy's k tensor blocks onto the training devices, (D - k) / k whole copies of them,
and each block is then copied device to device to its rollout device (a `device_put` whose
shards match the source's: never through host memory); the staged copy is freed when that ends.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def rollout_dtype(platform: str) -> Any:
    """dtype of the sampler's rollout copy: bfloat16 on accelerators (the sampler computes in
    bf16 and its HBM goes to the KV cache); None (the parameters' own dtype) on CPU, where
    the float32 "checked" LM head needs the float32 weights (so CPU samples stay identical)."""
    return None if platform == "cpu" else jnp.bfloat16


def _rollout_specs(graphdef: Any, params: Any, mesh: Any) -> Any:
    """The sampler's layout of every parameter on `mesh` (pure dict of NamedShardings): the
    model's logical rules, so on a (process x local) mesh whose axes are ("data", "tensor")
    the weights are tensor-parallel over a host's local chips and replicated over hosts."""
    from flax import nnx

    from actionopd_jax.model.sharding import param_shardings

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    state = nnx.state(nnx.merge(graphdef, abstract))
    return nnx.to_pure_dict(param_shardings(state, mesh))


def _cast_fn(dtype: Any):
    def cast(tree):
        if dtype is None:
            return tree
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    return cast


_RESHARD: dict[Any, Any] = {}


def _reshard(params: Any, target: Any, dtype: Any) -> Any:
    """jit(cast, out_shardings=target)(params), the jitted function kept per (dtype, target)
    so a step's reshard reuses the program compiled for the first step."""
    leaves, treedef = jax.tree.flatten(target)
    key = (None if dtype is None else jnp.dtype(dtype).name, treedef, tuple(leaves))
    fn = _RESHARD.get(key)
    if fn is None:
        fn = _RESHARD[key] = jax.jit(_cast_fn(dtype), out_shardings=target)
    return fn(params)


def _split_rollout(params: Any, graphdef: Any, devices: Any, dtype: Any) -> tuple[Any, Any]:
    """The copy on a "tensor" mesh over `devices` (disjoint from the training devices): staged
    by one jitted program on the training devices in the copy's own blocks, then copied block
    for block (module docstring)."""
    from jax.sharding import AxisType, Mesh, NamedSharding

    devices = list(devices)
    leaves = jax.tree.leaves(params)
    if len({frozenset(x.sharding.device_set) for x in leaves}) != 1:
        raise ValueError("rollout_params: the training parameters are not all on one device set")
    # in the training mesh's device order: jit wants its outputs on the inputs' device assignment
    first = leaves[0].sharding
    train_devices = list(first.mesh.devices.flat) if hasattr(first, "mesh") else sorted(first.device_set,
                                                                                         key=lambda d: d.id)
    if set(train_devices) & set(devices):
        raise ValueError(f"rollout_params: the rollout devices {[d.id for d in devices]} overlap the training "
                         f"devices {[d.id for d in train_devices]}")
    k = len(devices)
    if len(train_devices) % k:
        raise ValueError(f"rollout_params: {len(train_devices)} training devices do not hold whole copies of "
                         f"{k} rollout blocks (train/preflight.mesh_sizes refuses such a split)")
    rollout_mesh = Mesh(np.array(devices), ("tensor",), axis_types=(AxisType.Auto,))
    target = _rollout_specs(graphdef, params, rollout_mesh)
    stage_mesh = Mesh(np.array(train_devices).reshape(len(train_devices) // k, k), ("copies", "tensor"),
                      axis_types=(AxisType.Auto,) * 2)
    staged = _reshard(params, jax.tree.map(lambda s: NamedSharding(stage_mesh, s.spec), target), dtype)
    return jax.device_put(staged, target), rollout_mesh


def rollout_params(params: Any, graphdef: Any, *, platform: str | None = None,
                   dtype: Any = "auto", devices: Any = ()) -> tuple[Any, Any]:
    """(the sampler's rollout copy of `params`, the mesh to trace under), made on device.

    The copy is tensor-parallel over this process's local devices (mesh {"tensor": local}),
    in `dtype` ("auto": `rollout_dtype` of the platform: bfloat16 on accelerators, the
    parameters' own dtype on CPU). It is a new array (the trainer donates `params` to the
    update that follows collection).

    One process on CPU: the training placement as it is, None (unchanged behaviour: the
    float32 "checked" head samples the float32 weights on the training mesh).
    Otherwise one jitted identity (plus the cast) with out_shardings on a global mesh
    (processes x local devices, axes ("data", "tensor"); the parameters only name "tensor",
    so they are replicated over processes) moves the weights device to device -- XLA's
    collectives over ICI/DCN, never through host memory, and every process runs it at the
    same point of its step. Each process then wraps its own shards as arrays on its local
    mesh (`jax.make_array_from_single_device_arrays`, zero copy), so sampling needs no
    cross-process operation.

    `devices` (train/setup.rollout_devices: the host's last mesh.rollout_devices devices, off
    the training mesh): the copy goes to a "tensor" mesh over them instead, on CPU too (in
    the parameters' own dtype there); one process only."""
    from jax.sharding import AxisType, Mesh, NamedSharding

    if devices:
        if jax.process_count() > 1:
            raise ValueError("rollout_params: a device split (mesh.rollout_devices) runs on one process only")
        if isinstance(dtype, str) and dtype == "auto":
            dtype = rollout_dtype(platform or devices[0].platform)
        return _split_rollout(params, graphdef, devices, dtype)
    leaves = jax.tree.leaves(params)
    single = all(getattr(x, "is_fully_addressable", True) for x in leaves)
    devices = jax.devices()
    platform = platform or devices[0].platform
    if isinstance(dtype, str) and dtype == "auto":
        dtype = rollout_dtype(platform)
    if single and platform == "cpu" and dtype is None:
        return params, None
    local = sorted(jax.local_devices(), key=lambda d: d.id)
    n_proc = jax.process_count()
    by_process = [sorted((d for d in devices if d.process_index == p), key=lambda d: d.id) for p in range(n_proc)]
    if any(len(row) != len(local) for row in by_process):
        raise ValueError("rollout_params needs the same number of devices in every process")
    local_mesh = Mesh(np.array(by_process[jax.process_index()]), ("tensor",), axis_types=(AxisType.Auto,))
    if n_proc == 1:
        target = _rollout_specs(graphdef, params, local_mesh)
        return _reshard(params, target, dtype), local_mesh
    global_mesh = Mesh(np.array(by_process), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    target = _rollout_specs(graphdef, params, global_mesh)
    placed = _reshard(params, target, dtype)

    def to_local(x):
        spec = x.sharding.spec
        shards = [s.data for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(local_mesh, spec), shards)

    return jax.tree.map(to_local, placed), local_mesh


def behaviour_model(policy: Any, ctx: Any, devices: Any = ()) -> tuple[Any, Any]:
    """(the step's behaviour snapshot as a model this process can sample with, the mesh to
    trace under): the rollout copy (`rollout_params`: bf16 on accelerators, resharded on
    device tensor-parallel over this process's devices, or over `devices`, the sampler's
    own); on a single CPU process without a split the training placement as it is."""
    from flax import nnx

    params, mesh = rollout_params(policy.params, policy.graphdef, devices=devices)
    return nnx.merge(policy.graphdef, params), (ctx.mesh if mesh is None else mesh)


def load_behaviour(sampler: Any, policy: Any, mesh: Any, devices: Any = ()) -> None:
    """Load the step's rollout copy of `policy` into `sampler` (Sampler.load_policy, checked);
    `mesh`: where to trace when the copy keeps the training placement (one CPU process);
    `devices`: the sampler's own devices (mesh.rollout_devices; () = this process's all)."""
    params, rollout_mesh = rollout_params(policy.params, policy.graphdef, devices=devices)
    sampler.load_policy(policy.graphdef, params, mesh if rollout_mesh is None else rollout_mesh)
