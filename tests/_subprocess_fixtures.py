"""The environment for tests that run `python -m actionopd_jax.commands ...` in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The suite compiles thousands of small CPU programs and spends most of its time compiling, not
# running them: LLVM at -O0 without its expensive passes compiles them ~30% faster (measured on
# tests/test_train_step.py + test_sampler_model.py: 168 s -> 122 s, docs/measurements.md).
# XLA:CPU's older elemental emitters instead of its MLIR fusion emitters, and one LLVM module
# instead of parallel codegen splits (two workers already fill two cores), halve the backend
# compile again: test_train_step.py 113 s -> 56 s (backend compiles 80 s -> 25 s),
# test_sampler_model.py 77 s -> 41 s (jaxlib 0.10.2). jaxlib 0.11 dropped the emitter switch
# and XLA stops at start-up on an unknown flag, so it is passed only where it exists.
# Tests only: `train`/`eval`/`serve` and the benchmarks compile at XLA's default level.
TEST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                      " --xla_cpu_parallel_codegen_split_count=1")


def _has_emitter_switch() -> bool:
    """Whether the installed jaxlib (read without importing jax: XLA_FLAGS must be set first)
    still has `--xla_cpu_use_fusion_emitters`: 0.10 and before."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(p) for p in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) < (0, 11)


if _has_emitter_switch():
    TEST_COMPILE_FLAGS += " --xla_cpu_use_fusion_emitters=false"

# `jax.jit(..., compiler_options=RUN_OPTIMIZED)`: XLA's default level for the rare test program
# that runs long enough to pay for it (a fit of many steps); both options exist in every jaxlib.
RUN_OPTIMIZED = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False}


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process (this one or a child): `devices` host CPU devices, compiled
    with the suite's flags."""
    return f"--xla_force_host_platform_device_count={devices} {TEST_COMPILE_FLAGS}"


def cli_env(devices: int) -> dict[str, str]:
    """os.environ plus: `devices` CPU devices, the CPU platform, the shared test compile cache
    (unless one is set) and the repo on PYTHONPATH. One builder so every subprocess test sees
    the same setup as the in-process tests (conftest.py)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/actionopd_jax/jax_test_cache"))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def finish_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each process's combined output once all have exited; every process still running is
    killed if one of them times out (a multi-process group cannot finish without its peers).
    Asserts that every process exited with 0, showing the failing one's output tail."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-5000:]
    return outs


def leave_jax_cluster(code: int = 0):
    """End a test's multi-process jax worker once its results are written: leave jax.distributed
    together (its shutdown is a barrier), flush, and exit without the interpreter's teardown.
    That teardown destroys XLA's CPU client, which joins a thread that can still be connecting a
    gloo communicator to a peer that has already exited: then the process never exits (about 1
    run in 10 on a loaded 2-core machine, with 2 or more CPU devices a process, jax 0.10.2 and
    0.11.2; not seen with one device a process in 40 runs)."""
    import jax

    jax.distributed.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
