"""TPU pod launcher: dry-run commands, real execution through subprocess argument lists, and
the remote command itself run by bash.

`gcloud` and `actionopd` are replaced by small recorder scripts on PATH (unavoidable: no TPU
slice or trainer here); they record the argv and environment they receive, which is exactly
what the launcher is responsible for. Secret Manager is a loopback server of ours.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actionopd_jax.launch import tpu_pod
from tests._launch_fixtures import SecretManagerStub, clear_google_credentials, forbid_network, make_checkout

FAKE_SECRET_VALUE = "sk-test-FAKE-VALUE-never-printed-42"
BASE = ["--name", "my-v5e-32", "--zone", "us-west4-a", "--project", "my-proj"]


@pytest.fixture
def checkout(tmp_path):
    return make_checkout(tmp_path / "repo")


def _dry_run(capsys, checkout, *flags) -> str:
    rc = tpu_pod.main([*BASE, "--repo-root", str(checkout), "--config", "configs/tiny.yaml", *flags, "--dry-run"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def _commands(printed: str) -> list[list[str]]:
    return [shlex.split(line) for line in printed.splitlines() if line and not line.startswith("#")]


def _remote(argv: list[str]) -> list[str]:
    """The words of the remote shell line carried by `--command=`."""
    (command,) = [a for a in argv if a.startswith("--command=")]
    return shlex.split(command.removeprefix("--command="))


def test_dry_run_runs_the_same_training_command_on_all_workers(capsys, checkout, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_SECRET_VALUE)
    attempts = forbid_network(monkeypatch)
    printed = _dry_run(capsys, checkout, "--secret", "OPENAI_API_KEY=teacher-api-key", "--env", "FOO=bar",
                       "train.steps=3", "run.name=a b")
    commands = _commands(printed)
    assert len(commands) == 1
    (train,) = commands
    assert train[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5e-32"]
    assert {"--worker=all", "--zone=us-west4-a", "--project=my-proj"} <= set(train)
    words = _remote(train)
    # exact training command at the end, the override with a space kept as one word
    assert words[-6:] == ["actionopd", "train", "--config", "configs/tiny.yaml", "train.steps=3", "run.name=a b"]
    entry = words.index("actionopd_jax.launch.entrypoint")
    assert words[entry + 1:entry + 4] == [
        "--secret", "OPENAI_API_KEY=projects/my-proj/secrets/teacher-api-key/versions/latest", "--"]
    assert "FOO=bar" in words and words[:2] == ["cd", "actionopd_jax"]
    assert FAKE_SECRET_VALUE not in printed
    assert attempts == []


def test_dry_run_setup_steps(capsys, checkout):
    copy = _commands(_dry_run(capsys, checkout, "--setup", "copy", "--install"))
    assert [c[0] for c in copy] == ["git", "gcloud", "gcloud", "gcloud", "gcloud"]
    assert copy[0][-1] == "HEAD" and "archive" in copy[0]
    assert copy[1][4] == "scp"
    assert "my-v5e-32:actionopd_jax.tar.gz" in copy[1] and "--worker=all" in copy[1]
    assert all("--worker=all" in c for c in copy[1:])
    assert "tar" in _remote(copy[2])
    install = " ".join(_remote(copy[3]))
    assert "python3 -m venv .venv" in install and install.endswith("bash install.sh tpu")
    clone = _commands(_dry_run(capsys, checkout, "--setup", "clone", "--repo-url",
                               "https://github.com/example/actionopd_jax.git", "--ref", "v1.2"))
    words = _remote(clone[0])
    assert "https://github.com/example/actionopd_jax.git" in words and "v1.2" in words


def test_launcher_executes_the_planned_argv_lists(checkout, tmp_path, monkeypatch):
    """Real execution: each planned argv reaches `gcloud` unchanged (no shell re-splitting)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "gcloud-calls.jsonl"
    _write_script(bin_dir / "gcloud", f"import json, sys\nopen({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    args = [*BASE, "--repo-root", str(checkout), "--config", "configs/tiny.yaml", "--install", "run.name=a b"]
    rc = tpu_pod.main(args)
    assert rc == 0
    launch = tpu_pod.launch_from_args(tpu_pod._parser().parse_args(args))
    expected = [list(c.argv[1:]) for c in tpu_pod.plan(launch)]
    assert [json.loads(line) for line in log.read_text().splitlines()] == expected
    # a failing step stops the launcher with its exit code
    _write_script(bin_dir / "gcloud", "import sys\nsys.exit(7)\n")
    assert tpu_pod.main(args) == 7


def _write_script(path: Path, body: str) -> None:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("detach", [False, True])
def test_remote_command_runs_trainer_with_env_file_env_and_secret(checkout, tmp_path, monkeypatch, detach):
    """Run the exact remote shell line with bash in a fake worker home directory."""
    home = tmp_path / "home"
    (home / "actionopd_jax" / ".venv" / "bin").mkdir(parents=True)
    trainer_bin = tmp_path / "trainer-bin"
    trainer_bin.mkdir()
    record = tmp_path / "trainer-call.json"
    _write_script(trainer_bin / "actionopd", (
        "import json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': {{k: os.environ.get(k) for k in "
        "('OPENAI_API_KEY', 'FOO', 'FROM_ENV_FILE')}}, open(" + repr(str(record)) + ", 'w'))\n"))
    # the venv's activate script puts the (stand-in) trainer and the venv's python on PATH, as a
    # real venv would: `python` there is this interpreter (with the package), whatever PATH had
    (home / "actionopd_jax" / ".venv" / "bin" / "activate").write_text(
        f'export PATH="{trainer_bin}:{Path(sys.executable).parent}:$PATH"\n')
    (home / "worker.env").write_text("FROM_ENV_FILE='from file'\n")
    resource = "projects/my-proj/secrets/teacher-api-key/versions/latest"
    with SecretManagerStub({resource: FAKE_SECRET_VALUE}) as stub:
        flags = [*BASE, "--repo-root", str(checkout), "--config", "configs/tiny.yaml",
                 "--secret", "OPENAI_API_KEY=teacher-api-key", "--env", "FOO=bar baz",
                 "--env-file", "worker.env", "train.steps=3", "run.name=it's"]
        if detach:
            flags += ["--detach-log", "train.log"]
        launch = tpu_pod.launch_from_args(tpu_pod._parser().parse_args(flags))
        line = tpu_pod.remote_train_command(launch)
        env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
        env.update(HOME=str(home), GOOGLE_APPLICATION_CREDENTIALS=str(stub.write_adc_file(tmp_path / "adc.json")),
                   ACTIONOPD_SECRET_MANAGER_ENDPOINT=stub.url, CLOUDSDK_CONFIG=str(tmp_path / "gcloud"))
        proc = subprocess.run(["bash", "-c", line], cwd=home, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        deadline = time.monotonic() + 60
        while detach and not record.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    call = json.loads(record.read_text())
    assert call["argv"] == ["train", "--config", "configs/tiny.yaml", "train.steps=3", "run.name=it's"]
    assert call["cwd"] == str(home / "actionopd_jax")
    assert call["env"] == {"OPENAI_API_KEY": FAKE_SECRET_VALUE, "FOO": "bar baz", "FROM_ENV_FILE": "from file"}
    assert FAKE_SECRET_VALUE not in line + proc.stdout + proc.stderr
    if detach:
        assert FAKE_SECRET_VALUE not in (home / "train.log").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--zone", "us-west4-a", "--project", "p1"], "missing --name"),
    (["--name", "s", "--project", "p1"], "missing --zone"),
    (["--name", "s", "--zone", "us-west4-a"], "missing --project"),
    (["--name", "s", "--zone", "us-west4", "--project", "p1"], "not a zone like us-west4-a"),
    (["--name", "S_1", "--zone", "us-west4-a", "--project", "p1"], "TPU names are lowercase"),
    ([*BASE, "--setup", "clone"], "--setup clone needs --repo-url"),
    ([*BASE, "--env", "HF_TOKEN=hf_abc"], "looks like a credential.*--secret HF_TOKEN=SECRET_NAME"),
    ([*BASE, "--secret", "OPENAI_API_KEY=" + FAKE_SECRET_VALUE], "not the secret value"),
    ([*BASE, "--remote-dir", "~/x"], "'~' is not expanded"),
    ([*BASE, "bad override"], "not of the form section.key=value"),
])
def test_input_errors_are_clear(capsys, checkout, flags, message):
    rc = tpu_pod.main([*flags, "--repo-root", str(checkout), "--config", "configs/tiny.yaml", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2
    assert re.search(message, err), err
    assert FAKE_SECRET_VALUE not in err


def test_unknown_or_outside_config_is_refused(capsys, checkout, tmp_path):
    assert tpu_pod.main([*BASE, "--repo-root", str(checkout), "--config", "configs/nope.yaml", "--dry-run"]) == 2
    assert "config file 'configs/nope.yaml' not found" in capsys.readouterr().err
    outside = tmp_path / "elsewhere.yaml"
    outside.write_text("a: 1\n")
    assert tpu_pod.main([*BASE, "--repo-root", str(checkout), "--config", str(outside), "--dry-run"]) == 2
    assert "outside the checkout" in capsys.readouterr().err
    (checkout / "configs" / "list.yaml").write_text("- 1\n")
    assert tpu_pod.main([*BASE, "--repo-root", str(checkout), "--config", "configs/list.yaml", "--dry-run"]) == 2
    assert "must be a YAML mapping" in capsys.readouterr().err


def test_dry_run_needs_no_credentials(capsys, checkout, monkeypatch, tmp_path):
    clear_google_credentials(monkeypatch, tmp_path)
    attempts = forbid_network(monkeypatch)
    assert _commands(_dry_run(capsys, checkout, "--setup", "copy", "--install"))
    assert attempts == []
