"""TPU pod launcher: run the same training command on every worker of a TPU VM slice.

    python launch/tpu_pod.py --name my-v5e-32 --zone us-west4-a --project my-proj \
        --setup copy --secret OPENAI_API_KEY=teacher-api-key \
        --config configs/paper/qwen3_8b_tpu.yaml train.steps=200 [--dry-run]

Every step is one `gcloud compute tpus tpu-vm {scp,ssh} ... --worker=all` invocation (plus a
local `git archive` for --setup copy). JAX's multi-controller model needs the same program
started on every host; `jax.distributed.initialize()` in the trainer then finds its peers
from the TPU metadata, so no per-worker settings are passed. Secrets travel as Secret
Manager names and are read on each worker by `actionopd_jax.launch.entrypoint`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

from actionopd_jax.launch.common import (LaunchError, PlannedCommand, find_repo_root, format_plan,
                                         parse_env_assignments, resolve_config, train_command)
from actionopd_jax.launch.secret_refs import SecretRef, parse_secret_flags

_SAFE_PATH_RE = re.compile(r"^[A-Za-z0-9._/+-]+$")
_TPU_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
_PROJECT_RE = re.compile(r"^[a-z0-9][a-z0-9.:-]{0,62}$")
SETUP_MODES = ("none", "copy", "clone")
# fails the install step early with a readable message (TPU VM images ship older Pythons)
_PYTHON_VERSION_CHECK = "import sys; sys.exit(sys.version_info < (3, 11))"
_PYTHON_VERSION_HELP = "actionopd_jax needs Python >= 3.11 on the TPU VM; pass --remote-python"


@dataclasses.dataclass(frozen=True)
class TpuPodLaunch:
    """Everything the launcher needs, already validated."""
    name: str
    zone: str
    project: str
    config: str                      # repo-relative path, same on the workers
    overrides: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    secrets: tuple[SecretRef, ...] = ()
    env_file: str | None = None      # file already on every VM, sourced before training
    remote_dir: str = "actionopd_jax"  # relative paths are under the ssh user's home
    setup: str = "none"              # none | copy (git archive of HEAD) | clone (--repo-url)
    repo_url: str | None = None
    ref: str = "main"
    install: bool = False
    remote_python: str = "python3"   # interpreter for the venv (must be >= 3.11)
    venv: str = ".venv"              # under remote_dir; "" uses the VM's python environment
    detach_log: str | None = None    # run in the background with nohup, logging here
    internal_ip: bool = False
    tunnel_through_iap: bool = False
    repo_root: Path = Path(".")


def _gcloud_tpu(launch: TpuPodLaunch, verb: str, *args: str) -> tuple[str, ...]:
    extra = []
    if launch.internal_ip:
        extra.append("--internal-ip")
    if launch.tunnel_through_iap:
        extra.append("--tunnel-through-iap")
    return ("gcloud", "compute", "tpus", "tpu-vm", verb, *args, f"--zone={launch.zone}",
            f"--project={launch.project}", "--worker=all", *extra)


def _ssh(launch: TpuPodLaunch, purpose: str, remote_command: str) -> PlannedCommand:
    return PlannedCommand(purpose, _gcloud_tpu(launch, "ssh", launch.name, f"--command={remote_command}"),
                          note=f"on every worker: {remote_command}")


def _activate(launch: TpuPodLaunch) -> list[str]:
    return [f". {shlex.quote(launch.venv)}/bin/activate"] if launch.venv else []


def remote_train_command(launch: TpuPodLaunch) -> str:
    """The shell line each worker runs (every token quoted; no secret values in it)."""
    parts = []
    if launch.env_file:
        # sourced from the home directory (before cd) with an explicit ./ so `.` does not search
        # PATH; `set -a` exports everything the file assigns; the values stay on the VM
        path = launch.env_file if launch.env_file.startswith("/") else f"./{launch.env_file}"
        parts.append(f"set -a && . {shlex.quote(path)} && set +a")
    parts += [f"cd {shlex.quote(launch.remote_dir)}", *_activate(launch)]
    argv: list[str] = []
    if launch.env:
        argv += ["env", *(f"{k}={v}" for k, v in launch.env)]
    if launch.secrets:
        argv += ["python", "-m", "actionopd_jax.launch.entrypoint"]
        for ref in launch.secrets:
            argv += ["--secret", ref.flag()]
        argv.append("--")
    argv += train_command(launch.config, list(launch.overrides))
    parts.append(shlex.join(argv))
    line = " && ".join(parts)
    if launch.detach_log:
        # nohup + closed stdin: the job survives the end of the ssh session
        line = (f"nohup bash -c {shlex.quote(line)} > {shlex.quote(launch.detach_log)} 2>&1 "
                "< /dev/null &")
    return line


def plan(launch: TpuPodLaunch, *, archive_path: str | None = None) -> list[PlannedCommand]:
    """The commands the launcher runs, in order."""
    steps: list[PlannedCommand] = []
    quoted_dir = shlex.quote(launch.remote_dir)
    if launch.setup == "copy":
        archive = archive_path or f"/tmp/actionopd_jax-{launch.name}.tar.gz"
        steps.append(PlannedCommand("pack the checkout's HEAD (commit local changes first)",
                                    ("git", "-C", str(launch.repo_root), "archive", "--format=tar.gz",
                                     f"--output={archive}", "HEAD")))
        steps.append(PlannedCommand("copy it to every worker",
                                    _gcloud_tpu(launch, "scp", archive,
                                                f"{launch.name}:actionopd_jax.tar.gz")))
        steps.append(_ssh(launch, "unpack on every worker",
                          f"mkdir -p {quoted_dir} && tar -xzf actionopd_jax.tar.gz -C {quoted_dir}"))
    elif launch.setup == "clone":
        url, ref = shlex.quote(launch.repo_url or ""), shlex.quote(launch.ref)
        steps.append(_ssh(launch, "clone or update the repository on every worker",
                          f"(test -d {quoted_dir}/.git || git clone --quiet {url} {quoted_dir}) && "
                          f"git -C {quoted_dir} fetch --quiet origin {ref} && "
                          f"git -C {quoted_dir} checkout --quiet --detach FETCH_HEAD"))
    if launch.install:
        py = shlex.quote(launch.remote_python)
        version_check = (f"{{ {py} -c {shlex.quote(_PYTHON_VERSION_CHECK)} || "
                         f"{{ echo {shlex.quote(_PYTHON_VERSION_HELP)} >&2; exit 1; }}; }}")
        parts = [f"cd {quoted_dir}", version_check]
        if launch.venv:
            parts.append(f"{py} -m venv {shlex.quote(launch.venv)}")
            parts += _activate(launch)
        parts.append("bash install.sh tpu")  # install.sh: pip install -e .[tpu] + benchmark packages
        steps.append(_ssh(launch, "install actionopd_jax[tpu] on every worker", " && ".join(parts)))
    steps.append(_ssh(launch, "train on every worker (same command, multi-controller JAX)",
                      remote_train_command(launch)))
    return steps


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python launch/tpu_pod.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--name", help="TPU VM (slice) name, as created with `gcloud compute tpus tpu-vm create`")
    p.add_argument("--zone", help="zone of the slice, e.g. us-west4-a")
    p.add_argument("--project", help="Google Cloud project id")
    p.add_argument("--config", help="training config inside the checkout, e.g. configs/paper/qwen3_8b_tpu.yaml")
    p.add_argument("overrides", nargs="*", help="config overrides section.key=value")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="plain environment variable for the trainer (not for credentials)")
    p.add_argument("--secret", action="append", default=[], metavar="ENV=SECRET",
                   help="fill ENV on each worker from Secret Manager secret SECRET "
                        "(name, name:version or projects/P/secrets/S/versions/V)")
    p.add_argument("--env-file", help="file already present on every VM with NAME=VALUE lines, sourced before training")
    p.add_argument("--setup", choices=SETUP_MODES, default="none",
                   help="how the code gets onto the workers")
    p.add_argument("--repo-url", help="git URL for --setup clone")
    p.add_argument("--ref", default="main", help="branch, tag or commit for --setup clone")
    p.add_argument("--install", action="store_true", help="run `bash install.sh tpu` in a venv on every worker")
    p.add_argument("--remote-dir", default="actionopd_jax", help="checkout location on the workers")
    p.add_argument("--remote-python", default="python3", help="Python >= 3.11 on the workers, for the venv")
    p.add_argument("--venv", default=".venv", help="venv inside --remote-dir ('' = none)")
    p.add_argument("--detach-log", help="run training in the background (nohup), logging to this file")
    p.add_argument("--internal-ip", action="store_true", help="ssh over internal IPs")
    p.add_argument("--tunnel-through-iap", action="store_true", help="ssh through IAP")
    p.add_argument("--repo-root", help="the local checkout (default: found from the current directory)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p


def _require(value: str | None, flag: str, example: str) -> str:
    if not value:
        raise LaunchError(f"missing {flag}: pass e.g. {flag} {example}")
    return value


def launch_from_args(args: argparse.Namespace) -> TpuPodLaunch:
    """Validate parsed flags into a TpuPodLaunch (LaunchError with a clear message otherwise)."""
    name = _require(args.name, "--name", "my-tpu-slice")
    zone = _require(args.zone, "--zone", "us-west4-a")
    project = _require(args.project, "--project", "my-gcp-project")
    if not _TPU_NAME_RE.match(name):
        raise LaunchError(f"--name {name!r}: TPU names are lowercase letters, digits and hyphens")
    if not _ZONE_RE.match(zone):
        raise LaunchError(f"--zone {zone!r} is not a zone like us-west4-a (a region has no TPU VMs)")
    if not _PROJECT_RE.match(project):
        raise LaunchError(f"--project {project!r} is not a Google Cloud project id")
    repo_root = Path(args.repo_root).resolve() if args.repo_root else find_repo_root()
    config = resolve_config(args.config, repo_root)
    for flag, value in (("--remote-dir", args.remote_dir), ("--env-file", args.env_file),
                        ("--venv", args.venv), ("--detach-log", args.detach_log),
                        ("--remote-python", args.remote_python)):
        if value and not _SAFE_PATH_RE.match(value):
            raise LaunchError(f"{flag} {value!r}: use a plain path (letters, digits, . _ / + -); "
                              "'~' is not expanded, relative paths are under the home directory")
    if args.setup == "clone" and not args.repo_url:
        raise LaunchError("--setup clone needs --repo-url (the git URL the workers clone)")
    if args.repo_url and args.setup != "clone":
        raise LaunchError("--repo-url is only used with --setup clone")
    return TpuPodLaunch(
        name=name, zone=zone, project=project, config=config,
        overrides=tuple(args.overrides), env=tuple(parse_env_assignments(args.env).items()),
        secrets=tuple(parse_secret_flags(args.secret, default_project=project)),
        env_file=args.env_file, remote_dir=args.remote_dir, setup=args.setup, repo_url=args.repo_url,
        ref=args.ref, install=args.install, remote_python=args.remote_python, venv=args.venv,
        detach_log=args.detach_log, internal_ip=args.internal_ip,
        tunnel_through_iap=args.tunnel_through_iap, repo_root=repo_root)


def execute(commands: list[PlannedCommand]) -> int:
    """Run the commands in order (argument lists, no shell); stop at the first failure."""
    for i, cmd in enumerate(commands, 1):
        print(f"# step {i}/{len(commands)}: {cmd.purpose}", flush=True)
        rc = subprocess.run(list(cmd.argv), check=False).returncode
        if rc != 0:
            print(f"tpu_pod: step {i} ({cmd.purpose}) failed with exit code {rc}", file=sys.stderr)
            return rc
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        launch = launch_from_args(args)
        # check the training command now, before any remote step runs
        train_command(launch.config, list(launch.overrides))
    except LaunchError as err:
        print(f"tpu_pod: {err}", file=sys.stderr)
        return 2
    commands = plan(launch)
    if args.dry_run:
        print(format_plan(commands))
        return 0
    return execute(commands)
