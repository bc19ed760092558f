"""The sampler's rollout copy (`sampling.rollout.rollout_params`) in one process: on CPU the
training placement as it is (the float32 "checked" head); the bf16 accelerator copy is a new
array resharded on device, tensor-parallel over the local devices."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from actionopd_jax.sampling.rollout import behaviour_model, rollout_dtype, rollout_params
from actionopd_jax.model import Qwen3
from actionopd_jax.model.sharding import make_mesh, param_shardings
from actionopd_jax.testing.tiny_checkpoint import tiny_config
from actionopd_jax.train.step import split_params


def _placed():
    cfg = tiny_config()
    graphdef, params = split_params(Qwen3(cfg, rngs=nnx.Rngs(params=jax.random.key(5))))
    mesh = make_mesh({"fsdp": jax.device_count()})
    shardings = nnx.to_pure_dict(param_shardings(nnx.state(nnx.merge(graphdef, params)), mesh))
    return graphdef, jax.device_put(params, shardings), mesh


def test_cpu_single_process_keeps_the_training_placement():
    graphdef, params, mesh = _placed()
    assert rollout_dtype("cpu") is None and rollout_dtype("tpu") == jnp.bfloat16
    same, m = rollout_params(params, graphdef)
    assert same is params and m is None
    policy = type("P", (), {"params": params, "graphdef": graphdef})()
    ctx = type("C", (), {"mesh": mesh})()
    model, sample_mesh = behaviour_model(policy, ctx)
    assert sample_mesh is mesh


def test_bf16_copy_is_resharded_on_device_tensor_parallel_over_local_devices():
    graphdef, params, _ = _placed()
    want = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), params)
    copy, mesh = rollout_params(params, graphdef, dtype=jnp.bfloat16)
    assert mesh.axis_names == ("tensor",) and mesh.size == len(jax.local_devices())
    leaves = jax.tree.leaves(copy)
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    assert all(x.sharding.mesh.devices.tolist() == mesh.devices.tolist() for x in leaves)
    assert any(x.ndim == 2 and "tensor" in jax.tree.leaves(tuple(x.sharding.spec)) for x in leaves)
    assert not any(x.ndim == 2 and x.sharding.spec == PartitionSpec("fsdp") for x in leaves)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), copy, want)
    # a new array: the trainer may donate the training parameters afterwards
    assert all(a is not b for a, b in zip(leaves, jax.tree.leaves(params)))
    assert all(not x.is_deleted() for x in jax.tree.leaves(params))


def test_the_reshard_program_is_reused_across_steps():
    from actionopd_jax.sampling import rollout as source

    graphdef, params, _ = _placed()
    rollout_params(params, graphdef, dtype=jnp.bfloat16)
    before = len(source._RESHARD)
    updated = jax.tree.map(lambda x: x + 1, params)      # the next step's parameters, same placement
    rollout_params(updated, graphdef, dtype=jnp.bfloat16)
    assert len(source._RESHARD) == before
