"""The host benchmarks/device_check.py runs on: which accelerator it has, the project's extra
installed where the jax already there does not see it, and the persistent compilation cache
its measuring children share (stdlib only at import: the parent process never starts jax)."""

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
# Ignored by git, so on a lent machine kept warm between calls it outlives the call: a rerun
# loads the programs the first call compiled (the 4B's unrolled decode and train programs take
# tens of seconds each), and within a call a train row's remat confirmation compiles the update
# its first step then loads (train/remat_confirm.py), where it used to compile it twice.
CACHE_DIR = ROOT / "runs" / "device_check_cache"
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "loaded", "/jax/compilation_cache/cache_misses": "compiled"}


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


def cache_dir(choice: str = "") -> str:
    """The measuring children's compilation cache: `choice` (--compile-cache; "off": none), else
    the one JAX_COMPILATION_CACHE_DIR names (the test suite's), else CACHE_DIR."""
    choice = choice.strip()
    if choice.lower() in ("off", "none"):
        return "off"
    return choice or os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(CACHE_DIR)


def start_cache(directory: str):
    """In a measuring child, before its first compile: jax's persistent cache in `directory`
    ("off": none) and a count of the programs it loaded and compiled (its hits and misses);
    returns a function giving the counts so far, {"loaded", "compiled"}. Programs compiled in
    under a second are not written (compile_cache.MIN_COMPILE_SECONDS), nor counted as loaded."""
    import jax

    counts = dict.fromkeys(_CACHE_EVENTS.values(), 0)

    def listen(event: str, **_) -> None:
        if event in _CACHE_EVENTS:
            counts[_CACHE_EVENTS[event]] += 1

    jax.monitoring.register_event_listener(listen)
    if directory != "off":
        from actionopd_jax.compile_cache import enable_compile_cache

        enable_compile_cache(directory)
    return lambda: dict(counts)


__all__ = ["CACHE_DIR", "EXTRA", "cache_dir", "describe", "detect_platform", "install", "start_cache"]
