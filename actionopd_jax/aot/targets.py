"""Named accelerator targets: topology, chips, and the per-chip figures a plan needs.

Peak bf16 FLOP/s and HBM bandwidth are the vendors' published per-chip numbers; HBM is what
the TPU compiler itself reports as the chip's capacity (v5p: "95.74G of hbm"), and for GPUs
what the device reports (aot/gpu_topology.HOPPER). They are used
only to turn compiler estimates into utilisation and to say how much memory is left.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from actionopd_jax.aot.gpu_topology import HOPPER

GiB = 1024 ** 3

# The share of an accelerator's memory a run plans for and lets XLA take, defined once: the GPU
# launchers and `actionopd train` set XLA_PYTHON_CLIENT_MEM_FRACTION to it, `train --check`
# compares its plan (train step and collection) with it, `--check --aot` wants compiled peaks
# below it, and the planned sampler budget lives within it. The rest is the runtime's (CUDA
# context, cuDNN/NCCL workspaces, fragmentation).
USABLE_MEMORY_FRACTION = 0.90


def take_usable_memory_share() -> None:
    """Before a job's first device query: on a GPU, XLA's allocator takes the share every plan
    assumes (jax's own default is 75%), so what a job sizes from the device's limit (the engine's
    pool, the static sampler's budget, `--check`'s plan) is what `train` plans. Every `actionopd`
    command calls it (commands/main.py), so eval and serve size their pools as training does. A
    value the user set is kept. No effect off GPU."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{USABLE_MEMORY_FRACTION:.2f}")


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    platform: str            # "tpu" | "gpu"
    topology: str            # jax topology name (TPU), e.g. "v5p:2x2x1"
    chips: int
    hbm_bytes: float         # per chip
    peak_bf16_flops: float   # per chip, dense
    hbm_bytes_per_s: float   # per chip
    hosts: int = 1

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts


def _tpu(name, topology, chips, hosts, hbm_gib, tflops, gbps) -> Target:
    return Target(name, "tpu", topology, chips, hbm_gib * GiB, tflops * 1e12, gbps * 1e9, hosts)


TARGETS: dict[str, Target] = {t.name: t for t in (
    # v5p: 95 GB HBM2e, 459 TFLOP/s bf16, 2,765 GB/s; 4 chips per host
    _tpu("v5p-8", "v5p:2x2x1", 4, 1, 95.74, 459, 2765),
    _tpu("v5p-16", "v5p:2x2x2", 8, 2, 95.74, 459, 2765),
    _tpu("v5p-32", "v5p:2x2x4", 16, 4, 95.74, 459, 2765),
    # v5e: 16 GB HBM2, 197 TFLOP/s bf16, 819 GB/s; 4 chips per host in these slices
    _tpu("v5e-16", "v5e:4x4", 16, 4, 15.75, 197, 819),
    _tpu("v5e-64", "v5e:8x8", 64, 16, 15.75, 197, 819),
    # v6e (Trillium): 32 GB HBM, 918 TFLOP/s bf16, 1,640 GB/s
    _tpu("v6e-8", "v6e:2x4", 8, 2, 31.25, 918, 1640),
    # NVIDIA Hopper, per GPU (dense bf16): H100 SXM 80 GB / 3.35 TB/s, H200 141 GB / 4.8 TB/s;
    # memory as the device reports it (gpu_topology.HOPPER: 81,559 and 143,771 MiB), so a
    # target's usable share is the bytes_limit a run on that GPU gets, and `--check --target`
    # chooses the remat the run chooses (80e9 and 141e9 put the H100's share 4.6 GiB lower)
    *(Target(f"{kind}x{n}", "gpu", "", n, HOPPER[kind].memory_bytes, 989e12, HOPPER[kind].bandwidth_bytes_per_s)
      for kind in ("h100", "h200") for n in (1, 8)),
)}


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}; known: {', '.join(TARGETS)}") from None


class TargetUnavailable(RuntimeError):
    """This machine cannot compile for the target (no libtpu, or no deviceless GPU compiler)."""


@functools.cache
def target_devices(name: str) -> tuple:
    """Devices of the target, compiled for without the hardware (TPU: libtpu's topology)."""
    target = get_target(name)
    from jax.experimental import topologies

    if target.platform == "gpu":
        import jax

        local = [d for d in jax.devices() if d.platform == "gpu"]
        if len(local) >= target.chips:  # on the GPU host itself: compile for its devices
            return tuple(local[:target.chips])
        # elsewhere XLA's deviceless GPU compiler, from the kind's description (aot/gpu_topology.py)
        from actionopd_jax.aot.gpu_topology import compile_devices

        try:
            return compile_devices(target.name, target.chips)
        except Exception as e:  # noqa: BLE001 - reported to the user as the reason
            raise TargetUnavailable(
                f"{name}: cannot compile for these GPUs without them here ({str(e).splitlines()[0][:300]}). "
                f"GPU memory is planned by `--check` only; or run the same command on a host with "
                f"{target.chips} GPUs") from None
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise TargetUnavailable(f"{name}: compiling for TPU needs libtpu: pip install -e '.[tpu]' "
                                "(the jax[tpu] pin; it runs on a CPU host too)") from None
    devices = topology_devices(target.topology, accelerator_type=target.name)
    if len(devices) != target.chips:
        raise AssertionError(f"{target.topology} has {len(devices)} chips, expected {target.chips}")
    return devices


def topology_devices(topology: str, *, accelerator_type: str = "") -> tuple:
    """The devices of a TPU topology ("v5p:2x2x1") from libtpu, without the hardware."""
    from jax.experimental import topologies

    # deviceless compiles never touch a chip: several processes may hold libtpu at once (else
    # the second one fails on libtpu's lockfile, e.g. two checks or parallel tests)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    quiet_libtpu_without_chips(accelerator_type or topology.replace(":", "-"))
    return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


def quiet_libtpu_without_chips(accelerator_type: str = "v5p-8") -> None:
    """On a host without TPU chips, name some slice and host for libtpu (when installed, e.g.
    by the tpu/test extras), so that jax's platform probe and deviceless compiles do not print
    pages of warnings about the TPU host it cannot find. A TPU VM (chips present) is untouched.
    Must run before jax initialises its backends (the first device query), not before import."""
    if os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0"):
        return
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


class _NoCudaPluginNoise:
    """Drops jax's "Jax plugin configuration error" record (a CUDA plugin installed for
    lowering, no driver to load): on a host with no NVIDIA device it is expected, not a fault."""

    def filter(self, record) -> bool:
        return not str(record.getMessage()).startswith("Jax plugin configuration error")


def quiet_cuda_plugin_without_gpus() -> None:
    """On a host with no NVIDIA device (no /dev/nvidia0, no nvidia-smi), drop the 20-line
    traceback jax logs at every start when the CUDA plugin (installed by the cuda-lower/test
    extras, for lowering) finds no driver. A host with a GPU is untouched, so a real driver or
    library failure there still shows in full. The plugin's C++ "cudart_stub ... Could not find
    cuda drivers" lines are dropped at the descriptor by commands/native_noise.py (absl prints
    them before any log level is read)."""
    import logging
    import shutil

    if os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi"):
        return
    # no driver to check against: without this the plugin's version check fails and it does not
    # register, and with it goes the deviceless GPU compiler (`--check --aot --target h100x1`)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    logging.getLogger("jax._src.xla_bridge").addFilter(_NoCudaPluginNoise())
