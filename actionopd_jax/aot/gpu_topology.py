"""Compile for NVIDIA GPUs on a host without them: XLA's deviceless GPU compiler.

jax's CUDA plugin (installed here by the cuda-lower/test extras, for lowering) can also build a
compile-only client from a GPU target description (XLA's `GpuTargetConfig`, a text proto) and a
topology "slices x hosts x GPUs": `jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=..., topology="1x1x8")`. Programs jitted over those devices are compiled by XLA's
real GPU pipeline (fusion, buffer assignment, cuDNN and Triton custom calls), nothing allocated
and nothing run, so `memory_analysis()` is XLA's own figure for the GPU, as the TPU topologies
give for TPUs. The compiler does not autotune without a device (GEMM tilings are its defaults),
so workspace sizes may differ a little from a compile on the device: these are compiler
estimates, labelled as such wherever they are printed.

Two conditions, both met on a CPU host by `quiet_cuda_plugin_without_gpus` (aot/targets.py)
before jax starts its backends:
- the plugin registers only when its CUDA version check passes or is skipped; with no driver it
  fails, so the check is skipped where there is no NVIDIA device
  (JAX_SKIP_CUDA_CONSTRAINTS_CHECK; JAX_PLATFORMS=cpu skips it too);
- the description is the device's own. The two lent kinds' facts are below, as the machines
  report them (nvidia-smi and torch there: 132 multiprocessors; 81,559 MiB and 50 MB of L2 on the "NVIDIA H100
  80GB HBM3", 143,771 MiB and 60 MB on the "NVIDIA H200"). On a GPU host jax gives the exact
  description (`device_target_config`), which the device check records.
"""

from __future__ import annotations

import dataclasses

MiB = 1024 ** 2


@dataclasses.dataclass(frozen=True)
class GpuFacts:
    description: str          # the device kind jax and nvidia-smi report
    memory_bytes: int         # total device memory (nvidia-smi)
    l2_bytes: int
    bandwidth_bytes_per_s: float
    multiprocessors: int = 132
    clock_ghz: float = 1.98   # boost clock, SXM parts
    compute_capability: tuple[int, int] = (9, 0)


HOPPER: dict[str, GpuFacts] = {
    "h100": GpuFacts("NVIDIA H100 80GB HBM3", 81_559 * MiB, 50 * MiB, 3.35e12),
    "h200": GpuFacts("NVIDIA H200", 143_771 * MiB, 60 * MiB, 4.8e12),
}


def target_config(facts: GpuFacts, *, dnn: tuple[int, int] = (9, 8), runtime: tuple[int, int] = (12, 8)) -> str:
    """XLA's GpuTargetConfig text proto for `facts` (Hopper's per-SM limits: 228 KiB of shared
    memory, 227 KiB a block opted in, 48 KiB by default, 64K registers, 2,048 threads)."""
    major, minor = facts.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {facts.multiprocessors}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(facts.bandwidth_bytes_per_s)}
  l2_cache_size: {facts.l2_bytes}
  clock_rate_ghz: {facts.clock_ghz}
  device_memory_size: {facts.memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} }}
runtime_version {{ major: {runtime[0]} minor: {runtime[1]} }}
device_description_str: "{facts.description}"
"""


def facts_for(target_name: str) -> GpuFacts:
    """The facts of an `aot.targets` GPU target ("h100x8" -> the H100's)."""
    kind = target_name.rstrip("0123456789").removesuffix("x")
    if kind not in HOPPER:
        raise ValueError(f"no deviceless GPU description for {target_name!r}; known: {', '.join(HOPPER)}")
    return HOPPER[kind]


def compile_devices(target_name: str, gpus: int, config: str | None = None) -> tuple:
    """`gpus` compile-only devices of one host of `target_name`'s GPU (`config`: a description
    read off a real device instead of the facts above). Raises RuntimeError saying why when this
    jax cannot (no CUDA plugin, or it did not register)."""
    from jax._src import xla_bridge
    from jax.experimental import topologies

    xla_bridge._discover_and_register_pjrt_plugins()
    if "cuda" not in getattr(xla_bridge, "_topology_factories", {"cuda": None}):
        raise RuntimeError("jax's CUDA plugin is not registered: install the cuda-lower extra "
                           "(pip install -e '.[cuda-lower]'), and on a host without a GPU start with "
                           "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 or JAX_PLATFORMS=cpu (`actionopd` sets it)")
    topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{gpus}",
                                            target_config=config or target_config(facts_for(target_name)))
    return tuple(topology.devices)


def device_target_config(devices) -> str | None:
    """The description jax reads off real GPUs (None where it cannot): what a later deviceless
    compile should use for this kind."""
    try:
        from jax._src.lib import xla_client

        return str(xla_client.get_topology_for_devices(list(devices)).target_config)
    except Exception:  # noqa: BLE001 - optional: the facts above stand in
        return None
