"""The environment for tests that run `python -m actionopd_jax.cli ...` in a child process."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cli_env(devices: int) -> dict[str, str]:
    """os.environ plus: `devices` CPU devices, the CPU platform, the shared test compile cache
    (unless one is set) and the repo on PYTHONPATH. One builder so every subprocess test sees
    the same setup as the in-process tests (conftest.py)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/actionopd_jax/jax_test_cache"))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env
