"""One process of the two-process behaviour-snapshot test (run as a script by
tests/test_collect_gather_multihost.py): joins jax.distributed on CPU, places a tiny student's
parameters sharded over a mesh that spans BOTH processes (so no process holds them whole),
then asks `sampling.rollout.rollout_params` / `behaviour_model` for the rollout copy this
process samples with (resharded on device over a (process x local) mesh, then wrapped as
local arrays), and greedy-samples from it. Writes what it saw as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEED = 11
PROMPTS = [[3, 9, 27, 81, 50], [7, 1, 2], [100, 101, 102, 103, 104, 105, 106]]


def build():
    """The tiny student every process (and the parent test) builds from SEED: (cfg, graphdef, params)."""
    import jax
    from flax import nnx

    from actionopd_jax.model import Qwen3
    from actionopd_jax.testing.tiny_checkpoint import tiny_config
    from actionopd_jax.train.step import split_params

    cfg = tiny_config()
    graphdef, params = split_params(Qwen3(cfg, rngs=nnx.Rngs(params=jax.random.key(SEED))))
    return cfg, graphdef, params


def greedy_tokens(model, mesh) -> list[list[list[int]]]:
    import jax
    import numpy as np

    from actionopd_jax.sampling import Sampler

    out = Sampler(model, eos_ids=[], mesh=mesh).sample([np.asarray(p, np.int32) for p in PROMPTS], n=2,
                                                        max_new_tokens=6, temperature=0.0, key=jax.random.key(0))
    return [[g.token_ids.tolist() for g in gens] for gens in out.generations]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import jax
    import numpy as np
    from flax import nnx

    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=2, process_id=args.process_id,
                               initialization_timeout=120)
    from actionopd_jax.sampling.rollout import behaviour_model, rollout_params
    from actionopd_jax.model.sharding import make_mesh, param_shardings

    cfg, graphdef, params = build()
    want = jax.tree.map(np.asarray, params)
    mesh = make_mesh({"fsdp": jax.device_count()}, devices=jax.devices())
    shardings = nnx.to_pure_dict(param_shardings(nnx.state(nnx.merge(graphdef, params)), mesh))
    placed = jax.tree.map(lambda w, s: jax.make_array_from_callback(w.shape, s, lambda idx, w=w: w[idx]),
                          want, shardings)

    local, local_mesh = rollout_params(placed, graphdef)
    local_only = all(x.is_fully_addressable and {d.process_index for d in x.sharding.device_set} == {args.process_id}
                     for x in jax.tree.leaves(local))
    same = jax.tree.leaves(jax.tree.map(lambda h, w: bool(np.array_equal(np.asarray(h), w)), local, want))
    model, sample_mesh = behaviour_model(SimpleNamespace(params=placed, graphdef=graphdef),
                                         SimpleNamespace(model_config=cfg, mesh=mesh))
    on = {d.id for x in jax.tree.leaves(nnx.state(model)) for d in x.sharding.device_set}
    result = dict(
        process_index=jax.process_index(), global_devices=jax.device_count(),
        placed_fully_addressable=any(x.is_fully_addressable for x in jax.tree.leaves(placed)),
        gathered_equal=all(same), leaves=len(same), rollout_local_only=local_only,
        rollout_tensor_sharded=any(x.sharding.spec != jax.sharding.PartitionSpec()
                                   for x in jax.tree.leaves(local) if x.ndim == 2),
        local_mesh_devices=sorted(d.id for d in local_mesh.devices.flat),
        local_devices=sorted(d.id for d in jax.local_devices()),
        model_devices=sorted(on), sample_mesh_is_local=sample_mesh.devices.tolist() == local_mesh.devices.tolist(),
        tokens=greedy_tokens(model, sample_mesh))
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    # only as a script: the test process imports build/greedy_tokens and keeps its own settings
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    from tests._subprocess_fixtures import leave_jax_cluster

    leave_jax_cluster(main())
