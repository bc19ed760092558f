"""The `launch/*.py` scripts run as documented, and every shipped config dry-runs through the
launchers meant for it."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests._configs import SHIPPED, repo_path

REPO = Path(__file__).resolve().parents[1]
FAKE_SECRET_VALUE = "sk-test-FAKE-VALUE-never-printed-42"


def _script(name: str, *args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "OPENAI_API_KEY": FAKE_SECRET_VALUE, **(env_extra or {})}
    return subprocess.run([sys.executable, str(REPO / "launch" / f"{name}.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def _main(name: str, *args: str) -> subprocess.CompletedProcess:
    """The script's `main` (what `launch/<name>.py` runs) called in this process, from the
    checkout, with the fake secret in the environment: a subprocess per dry run cost ~5 s of
    interpreter and import start-up each (~100 s for the file). The scripts themselves start as
    a user runs them in test_scripts_show_help."""
    import contextlib
    import importlib
    import io
    import os
    from unittest import mock

    main = importlib.import_module(f"actionopd_jax.launch.{name}").main
    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(REPO)
        with mock.patch.dict(os.environ, {"OPENAI_API_KEY": FAKE_SECRET_VALUE}), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's errors
                code = e.code if isinstance(e.code, int) else 2
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess([name, *args], code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("name", ["tpu_pod", "vertex", "local_gpu"])
def test_scripts_show_help(name):
    proc = _script(name, "--help")
    assert proc.returncode == 0, proc.stderr
    assert f"python launch/{name}.py" in proc.stdout and "--dry-run" in proc.stdout


# the configs issue 8 names; every configs/*.yaml is dry-run by the launchers its name targets
REQUIRED = ["tiny_cpu.yaml", "qwen3_4b_tpu.yaml", "qwen3_8b_tpu.yaml", "qwen3_4b_h200.yaml"]
TARGETS = {"_tpu.yaml": ["tpu_pod", "vertex-tpu"], "_h200.yaml": ["local-gpu"],
           "_h200x8.yaml": ["local-gpu", "vertex-h200"], "_cpu.yaml": ["local-cpu"]}


def _shipped() -> list[tuple[str, str]]:
    names = sorted({*REQUIRED, *SHIPPED})
    cases = []
    for name in names:
        targets = [t for suffix, ts in TARGETS.items() if name.endswith(suffix) for t in ts]
        cases += [(name, t) for t in targets or ["local-gpu"]]
    return cases


def test_required_configs_are_shipped():
    missing = [name for name in REQUIRED if name not in SHIPPED]
    assert not missing, f"configs missing: {missing}"


@pytest.mark.parametrize("config, target", _shipped())
def test_shipped_config_dry_runs(config, target):
    path = repo_path(config)
    assert (REPO / path).is_file(), f"shipped config {path} is missing"
    secret = ["--secret", "OPENAI_API_KEY=teacher-api-key"]
    vertex_common = ["--project", "my-proj", "--region", "us-central1", "--staging-bucket", "gs://b",
                     "--image", "us-docker.pkg.dev/my-proj/r/actionopd-jax:latest", *secret, "--config", path]
    if target == "tpu_pod":
        proc = _main("tpu_pod", "--name", "slice", "--zone", "us-west4-a", "--project", "my-proj",
                     *secret, "--config", path, "--dry-run")
        train = [line for line in proc.stdout.splitlines() if not line.startswith("#")][-1]
        (remote,) = [w for w in shlex.split(train) if w.startswith("--command=")]
        assert shlex.split(remote.removeprefix("--command="))[-4:] == ["actionopd", "train", "--config", path]
        assert "--worker=all" in shlex.split(train)
    elif target.startswith("vertex"):
        # the machines the recipes name (mesh.target v5p-8 / h200x8): the launcher refuses others
        machine = (["--machine-type", "ct5p-hightpu-4t", "--tpu-topology", "2x2x1"] if target == "vertex-tpu"
                   else ["--machine-type", "a3-ultragpu-8g"])
        proc = _main("vertex", *vertex_common, *machine, "--dry-run")
        assert proc.returncode == 0, proc.stderr
        command = json.loads(proc.stdout)["custom_job"]["jobSpec"]["workerPoolSpecs"][0]["containerSpec"]["command"]
        assert command[-2:] == ["--config", f"/workspace/actionopd_jax/{path}"]
    else:
        platform = "cpu" if target == "local-cpu" else "gpu"
        proc = _main("local_gpu", "--platform", platform, "--config", path, "--dry-run")
        assert proc.stdout.splitlines()[-1].endswith(f"actionopd train --config {path}")
    assert proc.returncode == 0, proc.stderr
    assert FAKE_SECRET_VALUE not in proc.stdout + proc.stderr


def test_vertex_refuses_a_recipe_for_other_hardware():
    """The single-H200 recipe on an 8 x H200 machine: refused before submitting, naming the
    target; with mesh.target overridden, the trainer's batch-layout message."""
    common = ["--project", "my-proj", "--region", "us-central1", "--staging-bucket", "gs://b",
              "--image", "us-docker.pkg.dev/my-proj/r/actionopd-jax:latest", "--machine-type", "a3-ultragpu-8g",
              "--config", repo_path("qwen3_4b_h200.yaml"), "--dry-run"]
    proc = _main("vertex", *common)
    assert proc.returncode == 2 and "is for mesh.target h200x1 (1 GPU chip(s))" in proc.stderr, proc.stderr
    proc = _main("vertex", *common, "mesh.target=h200x8")
    assert proc.returncode == 2, proc.stderr
    assert "train.microbatch_rows=1 must be a multiple of 8" in proc.stderr, proc.stderr
