"""Lowering a jitted program for a platform this host does not have (CUDA from a CPU host).

jax lowers to StableHLO for any registered platform without its devices:
`jitted.trace(*abstract).lower(lowering_platforms=("cuda",))`. Sharded programs trace over a
mesh of this host's CPU devices (the stand-ins: same count and layout as the target's GPUs).
What lowering proves: every primitive has a CUDA lowering, the cuDNN custom calls accept the
shapes and dtypes (jax checks them while tracing), and the shardings partition. What it does
not: XLA's GPU compile (memory, fusion), which aot/gpu_topology.py's deviceless GPU compiler does
(`aot.targets.target_devices`); cuDNN builds its graphs only on the device.

The platform a program is *traced for* decides which kernels it picks (cuDNN attention, the
sampler's accelerator path), so tracing for CUDA over CPU stand-ins runs under
`lowering_for("gpu")`; `traced_platform()` is what `model.attention.target_platform` reads.

Lowering for CUDA needs the `cuda-lower` extra (`jax[cuda12-local]`: the plugin that registers
the CUDA lowerings; jax 0.11's CUDA 13 plugin does as well, as on the GPU hosts) and cuDNN's
library (jax asks its version while tracing a cuDNN call); `cuda_lowering_missing()` names what
is not installed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
import time

import jax
from actionopd_jax.cuda_plugin import cuda_plugin
from actionopd_jax.jax_compat import set_mesh, triton_lowers_on_cpu_as

_TRACED_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("traced_for", default=None)
_CUSTOM_CALL = re.compile(r'custom_call @([\w$.\-]+)|call_target_name = "([^"]+)"')
_PARTITIONS = re.compile(r"mhlo\.num_partitions = (\d+)")


@contextlib.contextmanager
def lowering_for(platform: str):
    """Trace programs inside for `platform` ("gpu", "tpu", "cpu"), whatever devices the mesh holds."""
    token = _TRACED_FOR.set(platform)
    try:
        yield
    finally:
        _TRACED_FOR.reset(token)


@contextlib.contextmanager
def cuda_stand_in():
    """Within: programs lower for CUDA on this CPU host as for an H100 where jax asks the GPU's
    kind (jax 0.11's Pallas Triton kernels; jax_compat.triton_lowers_on_cpu_as). Trace and
    lower both inside. Nothing changes on a GPU host."""
    if jax.devices()[0].platform == "gpu":
        yield
        return
    with triton_lowers_on_cpu_as("H100"):
        yield


def traced_platform() -> str | None:
    """The platform set by an enclosing `lowering_for`, else None."""
    return _TRACED_FOR.get()


def cuda_lowering_missing() -> str:
    """What this environment lacks to lower for CUDA ("" when nothing)."""
    major = cuda_plugin()
    if major is None:
        return "the CUDA plugin is not installed: pip install -e '.[cuda-lower]' (or '.[cuda]' on a GPU host)"
    try:
        from jax._src.lib import cuda_versions
        if cuda_versions is None:
            raise RuntimeError("jax did not load the CUDA plugin's version module")
        cuda_versions.cudnn_get_version()
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return (f"cuDNN's library is not installed ({str(e).splitlines()[0][:120]}): "
                f"pip install --no-deps nvidia-cudnn-cu{major} (what `bash install.sh test` does)")
    return ""


@dataclasses.dataclass
class LoweringReport:
    """One program lowered for a platform (or why not)."""

    label: str
    platform: str
    ok: bool = False
    error: str = ""
    seconds: float = 0.0
    partitions: int = 1
    custom_calls: tuple[str, ...] = ()   # distinct custom-call targets in the StableHLO
    text_chars: int = 0

    def has_call(self, prefix: str) -> bool:
        return any(c.startswith(prefix) for c in self.custom_calls)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def lower_for(jitted, args: tuple, *, label: str, platform: str = "cuda", mesh=None,
              kwargs: dict | None = None, traced_for: str = "gpu") -> LoweringReport:
    """`jitted.trace(*args).lower(lowering_platforms=(platform,))` under `mesh` and
    `lowering_for(traced_for)`. Never raises for a tracing or lowering error: the error is
    the report (a refused shape, an unsupported primitive, a sharding that does not split)."""
    report = LoweringReport(label=label, platform=platform)
    t0 = time.perf_counter()
    try:
        with lowering_for(traced_for), set_mesh(mesh) if mesh is not None else contextlib.nullcontext(), \
                cuda_stand_in() if platform == "cuda" else contextlib.nullcontext():
            lowered = jitted.trace(*args, **(kwargs or {})).lower(lowering_platforms=(platform,))
            text = lowered.as_text()
    except Exception as e:  # noqa: BLE001 - the lowering's verdict is the result
        report.seconds = time.perf_counter() - t0
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        report.error = f"{type(e).__name__}: {lines[0] if lines else 'lowering failed'}"[:400]
        return report
    report.seconds = time.perf_counter() - t0
    report.ok = True
    report.text_chars = len(text)
    parts = _PARTITIONS.search(text)
    report.partitions = int(parts.group(1)) if parts else 1
    report.custom_calls = tuple(sorted({a or b for a, b in _CUSTOM_CALL.findall(text)}))
    return report
