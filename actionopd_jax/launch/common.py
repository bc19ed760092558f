"""Pieces every launcher shares: input checks, the training command, printing a plan.

A launcher turns user flags into commands that run `actionopd train --config C [overrides]`
somewhere else (every TPU-VM worker, a Vertex AI job, local processes). Everything here is
pure and offline so dry-runs and tests never touch the network.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import yaml

from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION


class LaunchError(ValueError):
    """Bad launcher input; the message says what is wrong and what to do."""


# The one training entry point all launchers run (see actionopd_jax/commands/train.py).
TRAIN_ENTRY: tuple[str, ...] = ("actionopd", "train")

ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# `a.b.c=value`: dotted config path, then anything (the trainer parses the value).
OVERRIDE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*=")
# Name parts that mark a credential; such variables must go through --secret (by reference).
_SECRET_NAME_PARTS = {"KEY", "APIKEY", "TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWD",
                      "CREDENTIAL", "CREDENTIALS", "AUTH"}
# Parallel GPU/XLA settings for one process that owns all local GPUs (shared by the local and
# Vertex GPU launchers). JAX preallocates 75% of GPU memory by default; training wants more:
# the fraction every plan assumes (config.USABLE_MEMORY_FRACTION).
# The XLA flag is checked to parse in tests (an unknown XLA flag aborts the process).
GPU_ENV_DEFAULTS: dict[str, str] = {
    "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{USABLE_MEMORY_FRACTION:.2f}",
    "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "NCCL_DEBUG": "WARN",
}


def find_repo_root(start: Path | None = None) -> Path:
    """The checkout that holds `configs/` and `pyproject.toml` (walks up from `start` or cwd)."""
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "pyproject.toml").is_file() and (candidate / "actionopd_jax").is_dir():
            return candidate
    package_parent = Path(__file__).resolve().parents[2]
    if (package_parent / "pyproject.toml").is_file():
        return package_parent
    raise LaunchError(
        f"cannot find the actionopd_jax checkout above {here}; run the launcher from the repository "
        "or pass --repo-root")


def resolve_config(config: str, repo_root: Path) -> str:
    """Check a training config exists inside the checkout; return its repo-relative POSIX path.

    The path must be inside the checkout because the remote side runs the same checkout
    (copied, cloned or baked into an image) and finds the file at the same relative place.
    """
    if not config:
        raise LaunchError("missing --config: pass a training config, e.g. --config configs/tiny/tiny_cpu.yaml")
    path = Path(config)
    if not path.is_absolute():
        # relative to cwd first, then to the checkout (so `configs/x.yaml` works from anywhere)
        path = path if path.exists() else repo_root / path
    path = path.resolve()
    if path.suffix not in (".yaml", ".yml"):
        raise LaunchError(f"config {config!r} is not a .yaml file")
    if not path.is_file():
        shipped = sorted(str(p.relative_to(repo_root / "configs")) for p in (repo_root / "configs").rglob("*.yaml"))
        raise LaunchError(f"config file {config!r} not found (looked at {path}); "
                          f"shipped configs in {repo_root / 'configs'}: {', '.join(shipped) or 'none'}")
    try:
        relative = path.relative_to(repo_root.resolve())
    except ValueError:
        raise LaunchError(f"config {path} is outside the checkout {repo_root}; copy it into "
                          "configs/ so the remote workers find it at the same path") from None
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise LaunchError(f"config {config!r} is not valid YAML: {err}") from None
    if not isinstance(loaded, dict):
        raise LaunchError(f"config {config!r} must be a YAML mapping of settings, got {type(loaded).__name__}")
    from actionopd_jax.config import ConfigError
    from actionopd_jax.config.files import read_config_file

    try:  # its `base:` chain too: a file the workers cannot load must not start a job
        read_config_file(path)
    except ConfigError as err:
        raise LaunchError(f"config {config!r}: {err}") from None
    return relative.as_posix()


def check_config_for_machine(path: Path, overrides: list[str], *, machine: str, platform: str, chips: int,
                             hosts: int, generation: str = "") -> None:
    """Refuse, before a job is submitted, a config the run would refuse on this machine: its
    mesh.target names other hardware, or its batch layout cannot be split over these chips
    and processes (the trainer's own start-up checks, train/preflight.py)."""
    from actionopd_jax.config import ConfigError
    from actionopd_jax.config.load import load_config
    from actionopd_jax.train.preflight import (check_batch_layout, check_mesh_covers_processes, check_rollout_split,
                                               mesh_sizes)

    try:
        cfg = load_config(path, overrides)
        if cfg.mesh.target:
            from actionopd_jax.aot.targets import get_target

            t = get_target(cfg.mesh.target)
            if (t.platform, t.chips) != (platform, chips) or (generation and not t.name.startswith(generation)):
                raise LaunchError(
                    f"{path.name} is for mesh.target {t.name} ({t.chips} {t.platform.upper()} chip(s)), but "
                    f"{machine} gives {chips} {generation or platform.upper()} chip(s): pick the config for this "
                    f"machine (configs/*: mesh.target) or override mesh.target=...")
        check_rollout_split(cfg, hosts)   # a device split is one host's (mesh.rollout_devices)
        sizes = mesh_sizes(cfg, chips)
        check_mesh_covers_processes(sizes, chips, hosts)
        check_batch_layout(cfg, sizes, hosts)
    except ConfigError as err:
        raise LaunchError(f"{path.name} on {machine}: {err}") from None


def check_overrides(overrides: list[str]) -> list[str]:
    """Each override must look like `section.key=value` (the trainer's override syntax)."""
    for item in overrides:
        if not OVERRIDE_RE.match(item):
            raise LaunchError(f"override {item!r} is not of the form section.key=value "
                              "(flags go before the config overrides)")
        if "\n" in item or "\x00" in item:
            raise LaunchError(f"override {item[: item.index('=')]!r} contains a newline or NUL byte")
    return list(overrides)


def train_command(config_path: str, overrides: list[str]) -> list[str]:
    """argv of the training command every worker runs."""
    return [*TRAIN_ENTRY, "--config", config_path, *check_overrides(overrides)]


def looks_like_secret_name(name: str) -> bool:
    parts = set(name.upper().split("_"))
    return bool(parts & _SECRET_NAME_PARTS) or name.upper().endswith(("APIKEY", "API_KEY"))


def parse_env_assignments(items: list[str]) -> dict[str, str]:
    """`--env NAME=VALUE` flags for plain settings; credential-like names are refused."""
    env: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise LaunchError(f"--env {item!r}: expected NAME=VALUE")
        if not ENV_NAME_RE.match(name):
            raise LaunchError(f"--env {item!r}: {name!r} is not a valid environment variable name")
        if looks_like_secret_name(name):
            raise LaunchError(
                f"--env {name}=...: {name} looks like a credential; never pass its value on the "
                f"command line. Store it in Secret Manager and pass --secret {name}=SECRET_NAME")
        if "\n" in value or "\x00" in value:
            raise LaunchError(f"--env {name}: the value contains a newline or NUL byte")
        env[name] = value
    return env


def merge_xla_flags(defaults: dict[str, str], user: dict[str, str]) -> dict[str, str]:
    """User settings win, except XLA_FLAGS which are concatenated (later flags override earlier)."""
    merged = {**defaults, **user}
    if "XLA_FLAGS" in defaults and "XLA_FLAGS" in user:
        merged["XLA_FLAGS"] = f"{defaults['XLA_FLAGS']} {user['XLA_FLAGS']}"
    return merged


@dataclasses.dataclass(frozen=True)
class PlannedCommand:
    """One command a launcher will run: what it is for, its argv, and extra env it sets."""
    purpose: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    note: str | None = None  # human-readable detail, printed as a comment

    def shell_line(self) -> str:
        """The command as one copy-pasteable shell line (every token quoted)."""
        prefix = ["env", *(f"{k}={v}" for k, v in self.env)] if self.env else []
        return shlex.join([*prefix, *self.argv])


def format_plan(commands: list[PlannedCommand]) -> str:
    lines = []
    for i, cmd in enumerate(commands, 1):
        lines.append(f"# step {i}: {cmd.purpose}")
        if cmd.note:
            lines.append(f"#   {cmd.note}")
        lines.append(cmd.shell_line())
    return "\n".join(lines)
