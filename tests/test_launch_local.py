"""Local GPU launcher: dry-run commands and env, the GPU XLA flags parse in this jaxlib, and
a real two-process `jax.distributed` run on CPU wired only through the launcher's env vars."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from actionopd_jax.launch import local_gpu
from actionopd_jax.launch.common import GPU_ENV_DEFAULTS
from tests._launch_fixtures import make_checkout

FAKE_SECRET_VALUE = "sk-test-FAKE-VALUE-never-printed-42"


@pytest.fixture
def checkout(tmp_path):
    return make_checkout(tmp_path / "repo")


def _dry_run(capsys, checkout, *flags) -> list[list[str]]:
    rc = local_gpu.main(["--repo-root", str(checkout), "--config", "configs/tiny.yaml", *flags, "--dry-run"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert FAKE_SECRET_VALUE not in out.out
    return [shlex.split(line) for line in out.out.splitlines() if not line.startswith("#")]


def _split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    assert words[0] == "env"
    env, i = {}, 1
    while "=" in words[i] and not words[i].startswith("-"):
        k, _, v = words[i].partition("=")
        env[k] = v
        i += 1
    return env, words[i:]


def test_single_host_uses_all_gpus_with_gpu_settings(capsys, checkout, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_SECRET_VALUE)  # inherited by the trainer, never printed
    (words,) = _dry_run(capsys, checkout, "--env", "NCCL_SOCKET_IFNAME=eth0", "train.steps=3")
    env, argv = _split_env(words)
    assert argv == ["actionopd", "train", "--config", "configs/tiny.yaml", "train.steps=3"]
    assert env == {**GPU_ENV_DEFAULTS, "NCCL_SOCKET_IFNAME": "eth0"}
    assert "CUDA_VISIBLE_DEVICES" not in env  # one process owns every local GPU


def test_multi_node_passes_coordinator_settings(capsys, checkout):
    (words,) = _dry_run(capsys, checkout, "--coordinator", "10.0.0.2:1234", "--num-processes", "4",
                        "--process-id", "3")
    env, _ = _split_env(words)
    assert {k: env[k] for k in ("ACTIONOPD_COORDINATOR", "ACTIONOPD_NUM_PROCESSES", "ACTIONOPD_PROCESS_ID")} == {
        "ACTIONOPD_COORDINATOR": "10.0.0.2:1234", "ACTIONOPD_NUM_PROCESSES": "4", "ACTIONOPD_PROCESS_ID": "3"}


def test_local_processes_get_distinct_ids_and_one_coordinator(capsys, checkout):
    commands = _dry_run(capsys, checkout, "--local-processes", "3", "--platform", "cpu")
    envs = [_split_env(words)[0] for words in commands]
    assert [e["ACTIONOPD_PROCESS_ID"] for e in envs] == ["0", "1", "2"]
    assert len({e["ACTIONOPD_COORDINATOR"] for e in envs}) == 1
    assert all(e["ACTIONOPD_NUM_PROCESSES"] == "3" and e["JAX_PLATFORMS"] == "cpu" for e in envs)


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "10.0.0.2:1234", "--num-processes", "2"], "need --coordinator HOST:PORT, --num-processes N"),
    (["--num-processes", "2", "--process-id", "0"], "need --coordinator"),
    (["--coordinator", "10.0.0.2", "--num-processes", "2", "--process-id", "0"], "must be host:port"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], r"must be in \[0, 2\)"),
    (["--local-processes", "2", "--process-id", "1"], "do not combine"),
    (["--env", "WANDB_API_KEY=abc"], "looks like a credential"),
])
def test_input_errors_are_clear(capsys, checkout, flags, message):
    import re

    rc = local_gpu.main(["--repo-root", str(checkout), "--config", "configs/tiny.yaml", *flags, "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(message, err), err


def test_gpu_xla_flags_parse_in_this_jaxlib():
    """An unknown XLA flag aborts the process, so the GPU defaults must parse (checked on CPU
    jaxlib, which shares the flag table); a made-up flag shows the check can fail."""
    def run(flags: str) -> int:
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        return subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.ones(2).block_until_ready()"],
                              env=env, capture_output=True, timeout=120).returncode
    assert run(GPU_ENV_DEFAULTS["XLA_FLAGS"]) == 0
    assert run("--xla_gpu_no_such_flag_for_test=true") != 0


WORKER = r"""
import json, os, sys
import numpy as np
from actionopd_jax.train.distributed_env import initialize_from_env
assert initialize_from_env(), "ACTIONOPD_* variables missing"
import jax
from jax.experimental import multihost_utils
gathered = multihost_utils.process_allgather(np.array([10 * (jax.process_index() + 1)]))
with open(sys.argv[1], "w") as f:
    json.dump({"index": jax.process_index(), "count": jax.process_count(),
               "global_devices": jax.device_count(), "local_devices": jax.local_device_count(),
               "gathered": np.asarray(gathered).ravel().tolist(),
               "compile_cache": jax.config.jax_enable_compilation_cache}, f)
jax.distributed.shutdown()
# past the interpreter's teardown, which can hang with several CPU devices a process
# (leave_jax_cluster in tests/_subprocess_fixtures.py says why)
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


def test_two_local_processes_form_one_jax_cluster(tmp_path):
    """Real multi-controller JAX on CPU: the launcher's env alone wires the two processes."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    commands = local_gpu.plan([sys.executable, str(script), "OUT"], platform="cpu", user_env={},
                              local_processes=2)
    # each process writes its own result file
    commands = [local_gpu.PlannedCommand(c.purpose, (*c.argv[:-1], str(tmp_path / f"out{i}.json")), c.env)
                for i, c in enumerate(commands)]
    assert local_gpu.run_concurrently(commands, timeout_s=240) == 0
    results = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    assert [r["index"] for r in results] == [0, 1]
    for r in results:
        assert r["count"] == 2
        assert r["global_devices"] == 2 * r["local_devices"]
        # a CPU cluster's persistent compile cache is off, as in the trainer (compile_cache.off_for_cpu_cluster)
        assert r["compile_cache"] is False
        assert r["gathered"] == [10, 20]  # a real cross-process collective


def test_a_failing_process_stops_the_others(tmp_path):
    fail = local_gpu.PlannedCommand("fails", (sys.executable, "-c", "import sys; sys.exit(5)"))
    hang = local_gpu.PlannedCommand("would wait forever", (sys.executable, "-c", "import time; time.sleep(600)"))
    assert local_gpu.run_concurrently([fail, hang], timeout_s=60) == 5
