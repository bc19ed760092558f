"""Vertex AI launcher: dry-run job specs (TPU and GPU pools), secrets only as references,
clear input errors, and no network or credentials needed to build or print a job."""

from __future__ import annotations

import json
import re

import pytest
from google.cloud.aiplatform_v1.types import AcceleratorType, CustomJob, Scheduling

from actionopd_jax.launch import vertex
from actionopd_jax.launch.common import GPU_ENV_DEFAULTS
from tests._launch_fixtures import clear_google_credentials, forbid_network, make_checkout

FAKE_SECRET_VALUE = "sk-test-FAKE-VALUE-never-printed-42"
COMMON = ["--project", "my-proj", "--region", "us-central1", "--staging-bucket", "gs://my-bucket",
          "--image", "us-docker.pkg.dev/my-proj/actionopd/actionopd-jax:latest"]
TPU = ["--machine-type", "ct5lp-hightpu-4t", "--tpu-topology", "4x4"]
H200 = ["--machine-type", "a3-ultragpu-8g"]


@pytest.fixture
def checkout(tmp_path):
    return make_checkout(tmp_path / "repo")


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No credentials anywhere and every connect / DNS lookup raises."""
    clear_google_credentials(monkeypatch, tmp_path)
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_SECRET_VALUE)
    return forbid_network(monkeypatch)


def _dry_run(capsys, checkout, *flags) -> tuple[dict, str]:
    rc = vertex.main([*COMMON, "--repo-root", str(checkout), "--config", "configs/tiny.yaml", *flags, "--dry-run"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out), out.out


def _env(pool: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pool["containerSpec"]["env"]}


def test_tpu_job_spec(capsys, checkout, offline):
    request, printed = _dry_run(capsys, checkout, *TPU, "train.steps=3", "run.name=a b")
    assert request["parent"] == "projects/my-proj/locations/us-central1"
    assert request["api_endpoint"] == "us-central1-aiplatform.googleapis.com"
    job = request["custom_job"]
    assert job["displayName"] == "actionopd-tiny"
    (pool,) = job["jobSpec"]["workerPoolSpecs"]
    # one replica stands for the whole 16-chip (4-host) slice
    assert pool["machineSpec"] == {"machineType": "ct5lp-hightpu-4t", "tpuTopology": "4x4"}
    assert pool["replicaCount"] == "1"
    assert pool["containerSpec"]["imageUri"] == "us-docker.pkg.dev/my-proj/actionopd/actionopd-jax:latest"
    assert pool["containerSpec"]["command"] == [
        "actionopd", "train", "--config", "/workspace/actionopd_jax/configs/tiny.yaml", "train.steps=3", "run.name=a b"]
    assert _env(pool) == {"PYTHONUNBUFFERED": "1"}  # no GPU settings on TPU
    assert job["jobSpec"]["baseOutputDirectory"] == {"outputUriPrefix": "gs://my-bucket/actionopd/actionopd-tiny"}
    assert offline == []


def test_h200_two_node_job_spec_with_secret_reference(capsys, checkout, offline):
    request, printed = _dry_run(capsys, checkout, *H200, "--replicas", "2", "--secret",
                                "OPENAI_API_KEY=teacher-api-key", "--env", "XLA_FLAGS=--xla_dump_to=/tmp/x",
                                "--service-account", "trainer@my-proj.iam.gserviceaccount.com",
                                "--timeout-hours", "12", "--spot", "--label", "team=rl", "train.steps=3")
    spec = request["custom_job"]["jobSpec"]
    pools = spec["workerPoolSpecs"]
    # primary pool (1 replica) + the other node in pool 1, same machine and command
    assert [p["replicaCount"] for p in pools] == ["1", "1"]
    for pool in pools:
        assert pool["machineSpec"] == {"machineType": "a3-ultragpu-8g", "acceleratorType": "NVIDIA_H200_141GB",
                                       "acceleratorCount": 8}
        assert pool["containerSpec"]["command"] == [
            "python", "-m", "actionopd_jax.launch.entrypoint",
            "--secret", "OPENAI_API_KEY=projects/my-proj/secrets/teacher-api-key/versions/latest",
            "--vertex-cluster-spec", "--",
            "actionopd", "train", "--config", "/workspace/actionopd_jax/configs/tiny.yaml", "train.steps=3"]
        env = _env(pool)
        assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == GPU_ENV_DEFAULTS["XLA_PYTHON_CLIENT_MEM_FRACTION"]
        assert env["XLA_FLAGS"] == f"{GPU_ENV_DEFAULTS['XLA_FLAGS']} --xla_dump_to=/tmp/x"
        assert "OPENAI_API_KEY" not in env
    assert spec["serviceAccount"] == "trainer@my-proj.iam.gserviceaccount.com"
    assert spec["scheduling"] == {"timeout": "43200s", "strategy": "SPOT"}
    assert request["custom_job"]["labels"] == {"team": "rl"}
    assert FAKE_SECRET_VALUE not in printed
    assert offline == []


def test_h100_single_node_needs_no_entrypoint(capsys, checkout, offline):
    request, _ = _dry_run(capsys, checkout, "--machine-type", "a3-highgpu-8g", "--coordinator-port", "9999")
    (pool,) = request["custom_job"]["jobSpec"]["workerPoolSpecs"]
    assert pool["machineSpec"]["acceleratorType"] == "NVIDIA_H100_80GB"
    assert pool["machineSpec"]["acceleratorCount"] == 8
    assert pool["containerSpec"]["command"][:2] == ["actionopd", "train"]


def test_printed_json_is_the_submitted_proto(capsys, checkout, offline):
    """The printed request parses back into exactly the CustomJob proto `submit` would send."""
    flags = [*COMMON, *H200, "--replicas", "3", "--secret", "OPENAI_API_KEY=k", "--spot", "--timeout-hours", "1.5",
             "--boot-disk-gb", "500", "--repo-root", str(checkout), "--config", "configs/tiny.yaml", "train.steps=3"]
    assert vertex.main([*flags, "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    launch = vertex.launch_from_args(vertex._parser().parse_args(flags))
    job = vertex.build_custom_job(launch)
    assert CustomJob.from_json(json.dumps(printed["custom_job"])) == job
    # and the proto holds the typed values Vertex validates
    assert job.job_spec.worker_pool_specs[0].machine_spec.accelerator_type == AcceleratorType.NVIDIA_H200_141GB
    assert [p.replica_count for p in job.job_spec.worker_pool_specs] == [1, 2]
    assert job.job_spec.worker_pool_specs[1].disk_spec.boot_disk_size_gb == 500
    assert job.job_spec.scheduling.strategy == Scheduling.Strategy.SPOT
    assert job.job_spec.scheduling.timeout.total_seconds() == 5400


@pytest.mark.parametrize("flags, message", [
    (["--region", "us-central1", "--image", "i", *TPU], r"missing --project"),
    (["--project", "p1", "--image", "i", *TPU], r"missing --region"),
    (["--project", "p1", "--region", "us-central1", *TPU], r"missing --image"),
    (["--project", "p1", "--region", "us-central1", "--image", "i"], r"missing --machine-type"),
    (["--project", "p1", "--region", "us-central1-b", "--image", "i", *TPU], r"not a region .*not a zone"),
    (["--project", "p1", "--region", "us-central1", "--image", "i", *TPU], r"missing --staging-bucket"),
    (["--project", "p1", "--region", "us-central1", "--image", "i", "--staging-bucket", "my-bucket", *TPU],
     r"must be a gs:// location"),
    ([*COMMON, "--machine-type", "ct5lp-hightpu-4t"], r"TPU type: pass --tpu-topology"),
    ([*COMMON, "--machine-type", "ct5lp-hightpu-4t", "--tpu-topology", "2x2x2"], r"2 dimensions"),
    ([*COMMON, "--machine-type", "ct5lp-hightpu-8t", "--tpu-topology", "2x2"], r"not a multiple of 8"),
    ([*COMMON, *TPU, "--replicas", "2"], r"--replicas must be 1 for TPU"),
    ([*COMMON, *H200, "--tpu-topology", "4x4"], r"--tpu-topology is for TPU"),
    ([*COMMON, "--machine-type", "n1-standard-4"], r"not known; TPU: .*GPU: .*a3-ultragpu-8g"),
    ([*COMMON, *TPU, "--secret", f"OPENAI_API_KEY={FAKE_SECRET_VALUE}"], r"not the secret value"),
    ([*COMMON, *TPU, "--env", "OPENAI_API_KEY=x"], r"looks like a credential"),
    ([*COMMON, *TPU, "--workdir", "workspace"], r"absolute path"),
    ([*COMMON, *TPU, "--label", "Team=RL"], r"--label 'Team=RL'"),
    ([*COMMON, *TPU, "--service-account", "not-an-email"], r"not a service account email"),
])
def test_input_errors_are_clear(capsys, checkout, offline, flags, message):
    rc = vertex.main([*flags, "--repo-root", str(checkout), "--config", "configs/tiny.yaml", "--dry-run"])
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""
    assert re.search(message, out.err), out.err
    assert FAKE_SECRET_VALUE not in out.err


def test_unknown_config_lists_the_shipped_ones(capsys, checkout, offline):
    rc = vertex.main([*COMMON, *TPU, "--repo-root", str(checkout), "--config", "configs/qwen3_70b.yaml", "--dry-run"])
    assert rc == 2
    assert re.search(r"config file 'configs/qwen3_70b.yaml' not found.*tiny.yaml", capsys.readouterr().err)
