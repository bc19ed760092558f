"""`actionopd train` end to end through the real command (a subprocess): --smoke, a plain
run with its run directory, and --resume. The groups come from the synthetic source, which
stands in for the collector until `collect.kind=actionopd` is wired. With the embedded defaults
`actionopd train` runs the main job (tests/test_experiment_main_job.py), so the plain trainer runs
here pass experiment.enabled=false (--smoke always runs the plain trainer)."""

import json
import subprocess
import sys

import yaml

from tests._subprocess_fixtures import cli_env


def _train(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "actionopd_jax.commands", "train", *args], cwd=cwd,
                          env={**cli_env(devices=1), **(env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)


def test_smoke_then_run_then_resume(tmp_path):
    # run.compile_cache_dir: the run's programs are written to the persistent cache there
    cache = tmp_path / "compile_cache"
    smoke = _train("--smoke", "run.tensorboard=false", f"run.compile_cache_dir={cache}", cwd=tmp_path,
                   env={"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    assert smoke.returncode == 0, smoke.stdout[-3000:]
    assert "smoke OK: 1 step(s) trained, checkpoint 1 restored identically" in smoke.stdout
    assert len([p for p in cache.rglob("*") if p.is_file()]) > 3
    (smoke_dir,) = list((tmp_path / "runs").glob("*-tiny_cpu-smoke"))

    first = _train("train.steps=2", "run.progress=false", "experiment.enabled=false", cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:]
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p != smoke_dir]
    assert run_dir.name.endswith("-tiny_cpu")
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["train"]["steps"] == 2 and resolved["train"]["lr"] == 1e-6  # every default written
    assert (run_dir / "train.log").is_file() and list((run_dir / "tb").iterdir())
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]

    # --resume finds the newest runs/*-tiny_cpu directory and continues it
    resumed = _train("train.steps=3", "run.progress=false", "experiment.enabled=false", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from step 2" in resumed.stdout
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    bad = _train("train.steps=4", "train.lr=1e-5", "experiment.enabled=false", "--resume", cwd=tmp_path)
    assert bad.returncode == 2 and "train.lr: 1e-06 -> 1e-05" in bad.stdout and "--force" in bad.stdout
