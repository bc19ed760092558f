"""Vertex AI worker pools for TPU slices and GPU nodes (machine tables + WorkerPoolSpec protos).

Built directly as `google.cloud.aiplatform_v1` protos: constructing them is pure (no
credentials, no project lookup, no network), so dry-runs and tests stay offline.
"""

from __future__ import annotations

import dataclasses
import math
import re

from google.cloud.aiplatform_v1.types import ContainerSpec, DiskSpec, EnvVar, MachineSpec, WorkerPoolSpec

from actionopd_jax.launch.common import LaunchError


@dataclasses.dataclass(frozen=True)
class TpuMachine:
    generation: str
    chips_per_host: int
    topology_dims: int  # 2 for v5e / v6e ("4x4"), 3 for v5p ("2x2x2")


@dataclasses.dataclass(frozen=True)
class GpuMachine:
    accelerator_type: str  # aiplatform_v1.AcceleratorType name
    gpus: int


# Vertex AI TPU machine types: the type fixes the generation and chips per host; the slice
# shape comes from tpu_topology and one replica stands for the whole (multi-host) slice.
TPU_MACHINES: dict[str, TpuMachine] = {
    "ct5lp-hightpu-1t": TpuMachine("v5e", 1, 2),
    "ct5lp-hightpu-4t": TpuMachine("v5e", 4, 2),
    "ct5lp-hightpu-8t": TpuMachine("v5e", 8, 2),
    "ct5p-hightpu-4t": TpuMachine("v5p", 4, 3),
    "ct6e-standard-1t": TpuMachine("v6e", 1, 2),
    "ct6e-standard-4t": TpuMachine("v6e", 4, 2),
    "ct6e-standard-8t": TpuMachine("v6e", 8, 2),
}

# GPU machine types: one replica = one node; every GPU of the node belongs to one process.
GPU_MACHINES: dict[str, GpuMachine] = {
    "a3-ultragpu-8g": GpuMachine("NVIDIA_H200_141GB", 8),
    "a3-megagpu-8g": GpuMachine("NVIDIA_H100_MEGA_80GB", 8),
    "a3-highgpu-8g": GpuMachine("NVIDIA_H100_80GB", 8),
    "a3-highgpu-4g": GpuMachine("NVIDIA_H100_80GB", 4),
    "a3-highgpu-2g": GpuMachine("NVIDIA_H100_80GB", 2),
    "a3-highgpu-1g": GpuMachine("NVIDIA_H100_80GB", 1),
    "a2-ultragpu-8g": GpuMachine("NVIDIA_A100_80GB", 8),
    "a2-ultragpu-1g": GpuMachine("NVIDIA_A100_80GB", 1),
}

_TOPOLOGY_RE = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


def is_tpu(machine_type: str) -> bool:
    return machine_type in TPU_MACHINES


def check_machine(machine_type: str, *, tpu_topology: str | None, replicas: int) -> None:
    """Clear errors for machine / topology / replica combinations Vertex would reject."""
    if machine_type in TPU_MACHINES:
        machine = TPU_MACHINES[machine_type]
        if not tpu_topology:
            raise LaunchError(f"--machine-type {machine_type} is a TPU type: pass --tpu-topology "
                              f"(e.g. {'4x4' if machine.topology_dims == 2 else '2x2x2'})")
        if not _TOPOLOGY_RE.match(tpu_topology) or tpu_topology.count("x") + 1 != machine.topology_dims:
            raise LaunchError(f"--tpu-topology {tpu_topology!r}: {machine.generation} topologies have "
                              f"{machine.topology_dims} dimensions, like "
                              f"{'4x4' if machine.topology_dims == 2 else '2x2x2'}")
        chips = math.prod(int(d) for d in tpu_topology.split("x"))
        if chips % machine.chips_per_host:
            raise LaunchError(f"--tpu-topology {tpu_topology} has {chips} chips, not a multiple of "
                              f"{machine.chips_per_host} chips per {machine_type} host")
        if replicas != 1:
            raise LaunchError("--replicas must be 1 for TPU: one replica is the whole slice; "
                              "choose the slice size with --tpu-topology")
    elif machine_type in GPU_MACHINES:
        if tpu_topology:
            raise LaunchError(f"--tpu-topology is for TPU machine types, not {machine_type}")
        if replicas < 1:
            raise LaunchError(f"--replicas must be >= 1 (GPU nodes), got {replicas}")
    else:
        raise LaunchError(f"--machine-type {machine_type!r} is not known; TPU: "
                          f"{', '.join(TPU_MACHINES)}; GPU: {', '.join(GPU_MACHINES)}")


def tpu_hosts(machine_type: str, tpu_topology: str) -> int:
    chips = math.prod(int(d) for d in tpu_topology.split("x"))
    return max(1, chips // TPU_MACHINES[machine_type].chips_per_host)


def machine_spec(machine_type: str, *, tpu_topology: str | None) -> MachineSpec:
    if machine_type in TPU_MACHINES:
        return MachineSpec(machine_type=machine_type, tpu_topology=tpu_topology)
    gpu = GPU_MACHINES[machine_type]
    return MachineSpec(machine_type=machine_type, accelerator_type=gpu.accelerator_type,
                       accelerator_count=gpu.gpus)


def worker_pools(*, machine_type: str, tpu_topology: str | None, replicas: int, image_uri: str,
                 command: list[str], env: dict[str, str], boot_disk_gb: int | None) -> list[WorkerPoolSpec]:
    """Pool 0 is the primary (one replica); further GPU nodes go to pool 1 with the same spec.

    Every replica runs the same command (multi-controller JAX); process ids follow the pool
    order, see distributed_env.settings_from_vertex_cluster_spec.
    """
    check_machine(machine_type, tpu_topology=tpu_topology, replicas=replicas)
    container = ContainerSpec(image_uri=image_uri, command=command,
                              env=[EnvVar(name=k, value=v) for k, v in env.items()])
    disk = DiskSpec(boot_disk_type="pd-ssd", boot_disk_size_gb=boot_disk_gb) if boot_disk_gb else None

    def pool(count: int) -> WorkerPoolSpec:
        spec = WorkerPoolSpec(machine_spec=machine_spec(machine_type, tpu_topology=tpu_topology),
                              replica_count=count, container_spec=container)
        if disk is not None:
            spec.disk_spec = disk
        return spec

    pools = [pool(1)]
    if replicas > 1:
        pools.append(pool(replicas - 1))
    return pools
