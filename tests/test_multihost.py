"""A real two-process `jax.distributed` run on CPU (localhost coordinator, gloo collectives):
train steps over a mesh spanning both processes, each feeding its own rows, a collective
checkpoint save, a two-process resume, and a resume of that checkpoint by one process.

Each process's groups come from the synthetic group source, which stands in for the
collector (seeded by (seed, step, process index), as the collector shares task starts).
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

from actionopd_jax.config import Config
from actionopd_jax.checkpoint import Checkpointer
from tests._subprocess_fixtures import cli_env, finish_all

REPO = Path(__file__).resolve().parents[1]

ARGS = ["checkpoint.every_steps=1", "mesh.data=2", "mesh.fsdp=2", "train.microbatch_rows=4",
        "train.minibatch_rows=8", "collect.synthetic.groups_per_step=3", "run.progress=false",
        "run.tensorboard=false"]
if "experiment" in Config().to_dict():  # the defaults may run the main job: ask for the plain trainer
    ARGS.append("experiment.enabled=false")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(run_dir, *extra):
    return [sys.executable, "-m", "actionopd_jax.commands", "train", "--run-dir", str(run_dir), *ARGS, *extra]


def _two_processes(run_dir, *extra, timeout=900):
    port = _free_port()
    procs = []
    for pid in range(2):
        dist = [f"run.distributed.coordinator_address=127.0.0.1:{port}", "run.distributed.num_processes=2",
                f"run.distributed.process_id={pid}", "run.distributed.initialization_timeout_s=120"]
        procs.append(subprocess.Popen(_cmd(run_dir, *dist, *extra), env=cli_env(devices=2), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return finish_all(procs, timeout)


def test_two_process_training_checkpoint_and_resume(tmp_path):
    outs = _two_processes(tmp_path, "train.steps=2")
    assert "process 0 of 2, 2 local / 4 global devices" in outs[0]
    assert "process 1 of 2" not in outs[1]  # process 1 logs warnings only
    # a CPU cluster runs without the persistent cache (compile_cache.off_for_cpu_cluster): with
    # it, the resume below deadlocked under jax 0.12.1
    assert "persistent compile cache off" in outs[0]
    ckpt = Checkpointer(tmp_path / "checkpoints", read_only=True)
    assert ckpt.steps() == [1, 2]
    meta = ckpt.read_meta(2)
    assert meta["process_count"] == 2 and meta["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
    assert meta["data"] == [{"next_step": 2}, {"next_step": 2}]  # both processes' iterator states
    ckpt.close()

    outs = _two_processes(tmp_path, "train.steps=3", "--resume")
    assert "resumed from step 2" in outs[0]
    # one process writes the run's logs and metrics; groups and rows count both processes
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["groups"] == 6 and r["updates"] >= 1 and r["loss"] == r["loss"] for r in records)
    log_text = (tmp_path / "train.log").read_text()
    assert " p0 " in log_text and " p1 " not in log_text

    # the two-process checkpoint resumes in ONE process on a different device count
    single = subprocess.run(_cmd(tmp_path, "train.steps=4", "mesh.data=1", "mesh.fsdp=-1", "--resume"),
                            env=cli_env(devices=4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=900)
    assert single.returncode == 0, single.stdout[-5000:]
    assert "resumed from step 3" in single.stdout
    assert Checkpointer(tmp_path / "checkpoints", read_only=True).latest_step() == 4


def test_a_lagging_process_makes_the_same_resume_choice(tmp_path):
    """Process 1 reaches the resume choice only once process 0 could have created the fresh
    run's checkpoint directory: both must still choose alike and meet in the same barriers
    (CI once failed here with "sync_global_devices name mismatch")."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "_resume_race_worker.py"),
                               "--coordinator", f"127.0.0.1:{port}", "--process-id", str(pid),
                               "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / f"p{pid}.json")],
                              env=cli_env(devices=1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in range(2)]
    finish_all(procs, timeout=300)
    seen = [json.loads((tmp_path / f"p{pid}.json").read_text()) for pid in range(2)]
    for s in seen:
        assert s["resume"] is None and s["auto"] is False and s["steps"] == []
    assert seen[1]["saw_dir"] is False  # process 0 waited for its peer's answer before creating it
    assert (tmp_path / "run" / "checkpoints").is_dir()
