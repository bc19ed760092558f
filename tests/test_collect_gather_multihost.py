"""The collector's multi-host rollout copy (`sampling.rollout.rollout_params` /
`behaviour_model`), in a real two-process `jax.distributed` run on CPU: the trainer's
parameters are sharded over a mesh spanning both processes; one on-device reshard (a jitted
identity with out_shardings on a (process x local) mesh: tensor-parallel over a process's
devices, replicated over processes; no host gather) leaves each process its own copy,
bit-identical to the weights (float32 on CPU: the bf16 copy is for accelerators), wrapped as
arrays on its own devices only, and it samples exactly what one process sampling the same
weights on the same local layout does."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
from flax import nnx

from tests._gather_dist_worker import build, greedy_tokens
from tests._subprocess_fixtures import cli_env, finish_all

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_gather_the_sharded_policy_and_sample_locally(tmp_path):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "_gather_dist_worker.py"),
                               "--coordinator", f"127.0.0.1:{port}", "--process-id", str(pid),
                               "--out", str(tmp_path / f"p{pid}.json")],
                              env=cli_env(devices=2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in range(2)]
    finish_all(procs, timeout=600)
    shares = [json.loads((tmp_path / f"p{pid}.json").read_text()) for pid in range(2)]

    # the same weights sampled by this process on a 2-device tensor mesh (the worker's local layout)
    from actionopd_jax.model.sharding import make_mesh, shard_model

    _, graphdef, params = build()
    mesh = make_mesh({"tensor": 2}, devices=jax.devices()[:2])
    want_tokens = greedy_tokens(shard_model(nnx.merge(graphdef, params), mesh), mesh)

    for pid, s in enumerate(shares):
        assert s["process_index"] == pid and s["global_devices"] == 4
        assert s["placed_fully_addressable"] is False          # no process held the policy whole
        assert s["gathered_equal"] is True and s["leaves"] > 5  # resharded bit-identically
        assert s["rollout_local_only"] is True and s["rollout_tensor_sharded"] is True
        assert s["local_mesh_devices"] == s["local_devices"] == s["model_devices"]  # only its own devices
        assert len(s["local_devices"]) == 2 and s["sample_mesh_is_local"] is True
        assert s["tokens"] == want_tokens
    assert shares[0]["local_devices"] != shares[1]["local_devices"]
