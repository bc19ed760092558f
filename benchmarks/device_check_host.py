"""The host benchmarks/device_check.py runs on: which accelerator it has, and the project's
extra installed where the jax already there does not see it (stdlib only: the parent process
never starts jax)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRA = {"gpu": "cuda", "tpu": "tpu"}


def detect_platform() -> str:
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidia0"):
        return "gpu"
    if glob.glob("/dev/accel*") or os.path.exists("/dev/vfio/0"):
        return "tpu"
    return "cpu"


def _jax_sees(platform: str) -> bool:
    probe = f"import jax, actionopd_jax.model; assert jax.devices()[0].platform == {platform!r}"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, cwd=ROOT).returncode == 0


def install(platform: str, dry_run: bool, skip: bool) -> dict:
    extra = EXTRA.get(platform, "")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "-e", f".[{extra}]"] if extra else []
    info = {"extra": extra, "command": " ".join(cmd), "seconds": 0.0, "skipped": ""}
    if dry_run or skip or not extra:
        info["skipped"] = "dry run" if dry_run else ("--no-install" if skip else "no accelerator")
        return info
    if _jax_sees(platform):
        info["skipped"] = f"jax already sees the {platform}"
        return info
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    return info


def describe(device) -> dict:
    """One device as the report lists it; a GPU's with the description XLA's deviceless compiler
    takes (aot/gpu_topology.py), so later compiles here use the lent kind's exact one."""
    out = {"kind": device.device_kind, "platform": device.platform,
           "bytes_limit": (device.memory_stats() or {}).get("bytes_limit")}
    if device.platform == "gpu":
        from actionopd_jax.aot.gpu_topology import device_target_config

        out["target_config"] = device_target_config([device])
    return out


__all__ = ["EXTRA", "describe", "detect_platform", "install"]
