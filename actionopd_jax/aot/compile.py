"""Compile a jitted program ahead of time and read the compiler's memory and cost numbers."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time

import jax
from actionopd_jax.jax_compat import set_mesh

GiB = 1024 ** 3
# the TPU compiler's two wordings of an out-of-memory verdict
_OOM = re.compile(r"Used ([\d.]+[KMGT]?) of ([\d.]+[KMGT]?) (\w+)")
_OOM_TEMPS = re.compile(r"out of memory on (\w+), the total memory required for (.+?) \(([\d.]+[KMGT]?)\) "
                        r"exceeds available \w+ \(([\d.]+[KMGT]?)\)")


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.1f} GiB" if abs(n) >= 0.1 * GiB else f"{n / 1024 ** 2:.1f} MiB"


@dataclasses.dataclass
class CompileReport:
    """Per-chip figures of one compiled SPMD program (or why it did not compile)."""

    label: str
    compile_s: float = 0.0
    ok: bool = False
    error: str = ""                  # first line(s) of the compiler's error
    out_of_memory: bool = False
    argument_bytes: float = 0.0      # inputs (parameters, optimizer state, batch)
    output_bytes: float = 0.0
    alias_bytes: float = 0.0         # outputs written in place of donated inputs
    temp_bytes: float = 0.0          # activations, gradients, workspaces
    code_bytes: float = 0.0
    host_temp_bytes: float = 0.0     # remat offloaded to pinned host memory
    flops: float = 0.0               # compiler's count (a while/scan body counted once)
    optimal_seconds: float = 0.0     # compiler's estimate (same caveat)
    bytes_accessed: float = 0.0

    @property
    def peak_bytes(self) -> float:
        """What the program needs resident on one chip."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "peak_bytes": self.peak_bytes}


@contextlib.contextmanager
def no_persistent_cache():
    """Deviceless compiles skip the persistent compilation cache: it cannot load executables
    for devices that are not on this host (reading one back warns). jax memoises whether the
    cache is in use, so that is reset on both sides."""
    def reset():
        try:
            from jax._src import compilation_cache
        except ImportError:  # a jax without it: the cache warning is harmless
            return
        compilation_cache.reset_cache()

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    reset()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        reset()


def _verdict(text: str) -> tuple[str, bool]:
    """(one line for the user, whether it is an out-of-memory verdict) from a compiler error."""
    used = _OOM.search(text)
    if used:
        return f"out of {used.group(3).upper()}: used {used.group(1)} of {used.group(2)}", True
    temps = _OOM_TEMPS.search(text)
    if temps:
        return (f"out of {temps.group(1)}: {temps.group(2)} need {temps.group(3)} > "
                f"{temps.group(4)} available"), True
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else "compile failed")[:300], "RESOURCE_EXHAUSTED" in text


def compile_for(jitted, args: tuple, *, label: str, mesh=None, kwargs: dict | None = None,
                persistent_cache: bool = False) -> CompileReport:
    """`jitted.lower(*args).compile()` (under `mesh`), never raising for compiler errors: an
    out-of-memory or lowering failure is a result to print, not a crash of the check.
    persistent_cache: compiled for this host's own devices, through the persistent cache where
    it is on (a later compile of the same program then loads it); else never (a target's)."""
    report = CompileReport(label=label)
    t0 = time.perf_counter()
    try:
        with contextlib.nullcontext() if persistent_cache else no_persistent_cache(), \
                set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            compiled = jitted.lower(*args, **(kwargs or {})).compile()
    except Exception as e:  # noqa: BLE001 - the compiler's verdict is the result
        report.compile_s = time.perf_counter() - t0
        report.error, report.out_of_memory = _verdict(str(e))
        return report
    report.compile_s = time.perf_counter() - t0
    report.ok = True
    mem = compiled.memory_analysis()
    if mem is not None:
        report.argument_bytes = float(mem.argument_size_in_bytes)
        report.output_bytes = float(mem.output_size_in_bytes)
        report.alias_bytes = float(mem.alias_size_in_bytes)
        report.temp_bytes = float(mem.temp_size_in_bytes)
        report.code_bytes = float(mem.generated_code_size_in_bytes)
        report.host_temp_bytes = float(getattr(mem, "host_temp_size_in_bytes", 0) or 0)
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    report.flops = float(cost.get("flops", 0.0))
    report.optimal_seconds = float(cost.get("optimal_seconds", 0.0))
    report.bytes_accessed = float(cost.get("bytes accessed", 0.0))
    return report
