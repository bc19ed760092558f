"""Secrets by reference and the job entrypoint.

The Secret Manager and OAuth token endpoints are a loopback HTTP server of ours
(tests/_launch_fixtures.SecretManagerStub); the client side is the real google-auth
refresh flow and our real REST call, and the entrypoint runs as a real subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from actionopd_jax.launch import distributed_env
from actionopd_jax.train import distributed_env as trainer_env
from actionopd_jax.launch.common import LaunchError
from actionopd_jax.launch.entrypoint import prepare_environment
from actionopd_jax.launch.secret_refs import SecretRef, access_secret, parse_secret_flag, parse_secret_flags
from tests._launch_fixtures import SecretManagerStub

RESOURCE = "projects/my-proj/secrets/teacher-api-key/versions/latest"
VALUE = "sk-loopback-secret-value-123"


# ---- parsing references -------------------------------------------------------------------

@pytest.mark.parametrize("flag, expected", [
    ("OPENAI_API_KEY=teacher-api-key", ("my-proj", "teacher-api-key", "latest")),
    ("OPENAI_API_KEY=teacher-api-key:7", ("my-proj", "teacher-api-key", "7")),
    ("OPENAI_API_KEY=projects/other-proj/secrets/k_1/versions/3", ("other-proj", "k_1", "3")),
    ("OPENAI_API_KEY=projects/123456/secrets/k", ("123456", "k", "latest")),
])
def test_secret_flag_forms(flag, expected):
    ref = parse_secret_flag(flag, default_project="my-proj", environ={})
    assert (ref.project, ref.secret, ref.version) == expected
    assert ref.env_name == "OPENAI_API_KEY"
    assert ref.resource == f"projects/{expected[0]}/secrets/{expected[1]}/versions/{expected[2]}"


def test_secret_value_instead_of_name_is_refused():
    # the exact value of the variable in the user's environment
    with pytest.raises(LaunchError, match="equals \\$TEACHER_KEY.*secret value"):
        parse_secret_flag("TEACHER_KEY=abcdef0123456789", default_project="p1",
                          environ={"TEACHER_KEY": "abcdef0123456789"})
    # a string in a well-known API key format
    with pytest.raises(LaunchError, match="looks like an API key"):
        parse_secret_flag("OPENAI_API_KEY=sk-proj-AbC123", default_project="p1", environ={})
    # characters a secret name cannot have
    with pytest.raises(LaunchError, match="not a Secret Manager secret name"):
        parse_secret_flag("K=abc+/def==", default_project="p1", environ={})


@pytest.mark.parametrize("flag, message", [
    ("OPENAI_API_KEY", "expected ENV_NAME=SECRET_NAME"),
    ("OPENAI_API_KEY=", "expected ENV_NAME=SECRET_NAME"),
    ("1BAD=k", "not a valid environment variable name"),
    ("K=projects/p/secrets", "is not projects/P/secrets/S"),
    ("K=name:v/1", "version"),
])
def test_secret_flag_errors(flag, message):
    with pytest.raises(LaunchError, match=message):
        parse_secret_flag(flag, default_project="p1", environ={})


def test_short_secret_name_needs_a_project_and_duplicates_are_refused():
    with pytest.raises(LaunchError, match="needs a project"):
        parse_secret_flag("K=name", default_project=None, environ={})
    with pytest.raises(LaunchError, match="given twice for K"):
        parse_secret_flags(["K=a", "K=b"], default_project="p1", environ={})


# ---- reading a secret through the real google-auth flow ------------------------------------

@pytest.fixture
def secret_manager(tmp_path, monkeypatch):
    with SecretManagerStub({RESOURCE: VALUE}) as stub:
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(stub.write_adc_file(tmp_path / "adc.json")))
        monkeypatch.setenv("ACTIONOPD_SECRET_MANAGER_ENDPOINT", stub.url)
        monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
        yield stub


def test_access_secret_uses_oauth_token_then_reads_payload(secret_manager):
    ref = parse_secret_flag(f"OPENAI_API_KEY={RESOURCE}", default_project=None, environ={})
    assert access_secret(ref) == VALUE
    # token first, then the access call with that token (the stub refuses it otherwise)
    assert secret_manager.requests == [("POST", "/token"), ("GET", f"/v1/{RESOURCE}:access")]


def test_access_secret_error_names_the_reference(secret_manager):
    missing = SecretRef("OPENAI_API_KEY", "my-proj", "no-such-secret")
    with pytest.raises(RuntimeError, match="projects/my-proj/secrets/no-such-secret/versions/latest.*404"):
        access_secret(missing)


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    # not the test run's own switches (CI exports ACTIONOPD_REQUIRE_*, a developer may set
    # ACTIONOPD_TEST_JAX_CACHE): the child must see exactly the ACTIONOPD_* settings the
    # entrypoint exports
    env = {k: v for k, v in os.environ.items()
           if k != "OPENAI_API_KEY" and not k.startswith(("ACTIONOPD_REQUIRE_", "ACTIONOPD_TEST_"))}
    env.update(extra)
    return env


def test_entrypoint_puts_secret_in_trainer_env_without_printing_it(secret_manager):
    child = ("import os, sys; sys.exit(0 if os.environ.get('OPENAI_API_KEY') == "
             f"{VALUE!r} else 3)")
    proc = subprocess.run(
        [sys.executable, "-m", "actionopd_jax.launch.entrypoint", "--secret", f"OPENAI_API_KEY={RESOURCE}",
         "--", sys.executable, "-c", child],
        env=_child_env({}), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert VALUE not in proc.stdout + proc.stderr
    assert f"OPENAI_API_KEY <- {RESOURCE}" in proc.stderr


def test_entrypoint_fails_clearly_for_a_missing_secret(secret_manager):
    proc = subprocess.run(
        [sys.executable, "-m", "actionopd_jax.launch.entrypoint", "--secret",
         "OPENAI_API_KEY=projects/my-proj/secrets/other/versions/2", "--", sys.executable, "-c", "pass"],
        env=_child_env({}), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "projects/my-proj/secrets/other/versions/2" in proc.stderr and "404" in proc.stderr
    assert VALUE not in proc.stderr


def test_entrypoint_refuses_short_names_and_empty_command():
    proc = subprocess.run([sys.executable, "-m", "actionopd_jax.launch.entrypoint", "--secret", "K=short",
                           "--", "true"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "projects/P/secrets/S/versions/V" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "actionopd_jax.launch.entrypoint"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "put the command after --" in proc.stderr


# ---- Vertex CLUSTER_SPEC -> ACTIONOPD_* multi-process settings ------------------------------

CLUSTER_SPEC = json.dumps({
    "cluster": {"workerpool0": ["primary-0:2222"], "workerpool1": ["node-0:2222", "node-1:2222"]},
    "environment": "cloud", "task": {"type": "workerpool1", "index": 1}})


def test_vertex_cluster_spec_process_ids_follow_pool_order():
    settings = distributed_env.settings_from_vertex_cluster_spec(CLUSTER_SPEC)
    # workerpool0 holds process 0; workerpool1 index 1 is the third replica -> process 2
    assert (settings.coordinator, settings.num_processes, settings.process_id) == ("primary-0:2222", 3, 2)
    primary = json.dumps({**json.loads(CLUSTER_SPEC), "task": {"type": "workerpool0", "index": 0}})
    settings = distributed_env.settings_from_vertex_cluster_spec(primary, coordinator_port=8476)
    assert (settings.coordinator, settings.process_id) == ("primary-0:8476", 0)
    with pytest.raises(ValueError, match="not a Vertex AI cluster spec"):
        distributed_env.settings_from_vertex_cluster_spec('{"cluster": {}}')


def test_entrypoint_exports_cluster_settings_to_the_command():
    child = ("import os, json; print(json.dumps({k: v for k, v in os.environ.items() "
             "if k.startswith('ACTIONOPD_')}))")
    proc = subprocess.run(
        [sys.executable, "-m", "actionopd_jax.launch.entrypoint", "--vertex-cluster-spec", "--",
         sys.executable, "-c", child],
        env=_child_env({"CLUSTER_SPEC": CLUSTER_SPEC}), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"ACTIONOPD_COORDINATOR": "primary-0:2222",
                                       "ACTIONOPD_NUM_PROCESSES": "3", "ACTIONOPD_PROCESS_ID": "2"}
    with pytest.raises(LaunchError, match="CLUSTER_SPEC is not set"):
        prepare_environment([], vertex_cluster_spec=True, coordinator_port=None, environ={})


def test_distributed_settings_from_env():
    assert trainer_env.settings_from_env({}) is None
    env = {"ACTIONOPD_COORDINATOR": "10.0.0.2:1234", "ACTIONOPD_NUM_PROCESSES": "4",
           "ACTIONOPD_PROCESS_ID": "3", "ACTIONOPD_LOCAL_DEVICE_IDS": "0,1"}
    assert trainer_env.settings_from_env(env).init_kwargs() == dict(
        coordinator_address="10.0.0.2:1234", num_processes=4, process_id=3, local_device_ids=[0, 1])
    assert trainer_env.settings_from_env(env).config_fields() == dict(
        coordinator_address="10.0.0.2:1234", num_processes=4, process_id=3)
    with pytest.raises(ValueError, match="ACTIONOPD_PROCESS_ID missing"):
        trainer_env.settings_from_env({"ACTIONOPD_COORDINATOR": "h:1", "ACTIONOPD_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match=r"must be in \[0, 4\)"):
        trainer_env.settings_from_env({**env, "ACTIONOPD_PROCESS_ID": "4"})
    with pytest.raises(ValueError, match="must be host:port"):
        trainer_env.settings_from_env({**env, "ACTIONOPD_COORDINATOR": "10.0.0.2"})
