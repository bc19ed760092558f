"""The checks a run makes before it starts, one set of functions for the run and `--check`.

`Trainer` and `build_mesh` call these with the devices the run has; `actionopd train --check`
calls the same functions with the devices of the config's target (`mesh.target`), so a
config the run would refuse is refused by the check with the same message. Only the
trainer's own checks live here (mesh, batch layout, attention, placement); the checks of a
group source live with the code that builds it.
"""

from __future__ import annotations

import dataclasses
import math

from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION
from actionopd_jax.config import Config, ConfigError


def mesh_sizes(cfg: Config, device_count: int) -> dict[str, int]:
    """The training mesh's axis sizes on a host of `device_count` devices: the -1 axis resolved
    against the devices training gets (all of them, or with mesh.rollout_devices = k the first
    device_count - k, which a fixed mesh must then use exactly); errors say what to set."""
    sizes = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    k = cfg.mesh.rollout_devices
    if k:
        return _split_mesh_sizes(sizes, device_count, k)
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if -1 in sizes.values():
        if device_count % fixed:
            raise ConfigError(f"{device_count} devices cannot be split into mesh {sizes}: "
                              f"the fixed axes multiply to {fixed}")
        sizes = {k: (device_count // fixed if v == -1 else v) for k, v in sizes.items()}
    elif fixed > device_count:
        raise ConfigError(f"mesh {sizes} needs {fixed} devices but only {device_count} are available; "
                          f"set one axis to -1 or change the sizes")
    return sizes


def _split_mesh_sizes(sizes: dict[str, int], device_count: int, k: int) -> dict[str, int]:
    """`mesh_sizes` with k of the host's devices kept for the sampler (mesh.rollout_devices)."""
    train = device_count - k
    if train < 1:
        raise ConfigError(f"mesh.rollout_devices={k} leaves no device for training on {device_count} device(s); "
                          f"set mesh.rollout_devices to at most {device_count - 1} (0: share every device)")
    if train % k:
        # the rollout copy is laid out in k blocks on the training devices and copied block for
        # block (sampling/rollout.py); without whole copies of the k blocks it would go through host memory
        ok = [j for j in range(1, device_count) if device_count % j == 0]
        raise ConfigError(f"mesh.rollout_devices={k} on {device_count} devices leaves {train} for training, not a "
                          f"multiple of {k}: the weights move to the sampler block for block, so the training "
                          f"devices must hold whole copies of the {k} blocks; set mesh.rollout_devices to one of "
                          f"{ok} (0: share every device)")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if -1 in sizes.values():
        if train % fixed:
            raise ConfigError(f"mesh.rollout_devices={k} leaves {train} of {device_count} devices for training, "
                              f"which mesh {sizes} cannot split (its fixed axes multiply to {fixed}); change "
                              f"the fixed axes or mesh.rollout_devices")
        return {a: (train // fixed if v == -1 else v) for a, v in sizes.items()}
    if fixed != train:
        raise ConfigError(f"mesh {sizes} uses {fixed} devices but mesh.rollout_devices={k} leaves {train} of "
                          f"{device_count} for training: make mesh.data x mesh.fsdp x mesh.tensor = {train} "
                          f"(e.g. mesh.fsdp=-1)")
    return dict(sizes)


def check_rollout_split(cfg: Config, processes: int) -> None:
    """mesh.rollout_devices splits one host's devices: one process only for now (each process
    would need its own split of its local devices and a per-host reshard)."""
    k = cfg.mesh.rollout_devices
    if k and processes > 1:
        raise ConfigError(f"mesh.rollout_devices={k} splits one host's devices and runs on one process only "
                          f"(this run has {processes}); set mesh.rollout_devices=0 for a multi-host run")


def check_mesh_covers_processes(sizes: dict[str, int], device_count: int, processes: int) -> None:
    """A multi-process run must put every device on the mesh (each process feeds its own)."""
    used = math.prod(sizes.values())
    if used < device_count and processes > 1:
        raise ConfigError(f"mesh {sizes} uses {used} of {device_count} devices; a multi-process "
                          "run must use all of them (set one mesh axis to -1)")


def check_batch_layout(cfg: Config, sizes: dict[str, int], processes: int) -> None:
    """Microbatch rows are split over mesh data x fsdp and over the processes that feed them."""
    t = cfg.train
    divisor = sizes.get("data", 1) * sizes.get("fsdp", 1)
    need = math.lcm(divisor, processes)
    if t.microbatch_rows % need:
        raise ConfigError(
            f"train.microbatch_rows={t.microbatch_rows} must be a multiple of {need} (rows are split "
            f"over mesh data x fsdp = {divisor} and over {processes} process(es))")


def check_attention(cfg: Config, qcfg, platform: str) -> None:
    """Refuse combinations the platform's attention kernel cannot run, before any compile
    (the refusals themselves live in model.attention.resolve)."""
    from actionopd_jax.model.attention import resolve

    try:
        resolve(cfg.model.attention, platform, shared_prompt=cfg.train.shared_prompt,
                heads=(qcfg.num_attention_heads, qcfg.num_key_value_heads, qcfg.head_dim), dtype=cfg.model.dtype)
    except ValueError as e:
        raise ConfigError(f"model.attention: {e}") from None


def check_run(cfg: Config, qcfg, sizes: dict[str, int], *, device_count: int, processes: int,
              platform: str) -> None:
    """Every trainer-level start-up check that depends on the config and the devices, in the
    run's order. The group source's own checks (collection settings, teacher, tasks) belong to
    whoever builds the source and run after these (baselines/wiring.check_collection for
    `actionopd train`)."""
    check_rollout_split(cfg, processes)
    check_mesh_covers_processes(sizes, device_count - cfg.mesh.rollout_devices, processes)
    check_batch_layout(cfg, sizes, processes)
    check_attention(cfg, qcfg, platform)


@dataclasses.dataclass(frozen=True)
class Placement:
    """What a plan is made for: the target's devices, or this host's."""

    devices: int
    processes: int
    platform: str
    device_kind: str = ""
    memory_gib: float | None = None      # per device, as built (None: unknown)
    usable_fraction: float = 1.0         # of memory_gib a run may use
    notes: tuple[str, ...] = ()

    @property
    def usable_gib(self) -> float | None:
        return None if self.memory_gib is None else self.memory_gib * self.usable_fraction

    @property
    def devices_per_process(self) -> int:
        return max(1, self.devices // self.processes)


def placement(cfg: Config, devices: int = 0) -> Placement:
    """The devices `--check` plans for: `--devices N` > mesh.target > a fixed mesh's size >
    this host's devices. Memory: mesh.device_memory_gb > the target's > this device's limit."""
    import jax

    sizes = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    notes: list[str] = []
    if cfg.mesh.target:
        from actionopd_jax.aot.targets import get_target

        t = get_target(cfg.mesh.target)
        n = devices or t.chips
        notes.append(f"note: planned for mesh.target {t.name} ({t.chips} {t.platform.upper()} chip(s), "
                     f"{t.hosts} host(s)), whatever this host has")
        mem = cfg.mesh.device_memory_gb or t.hbm_bytes / 1024**3
        return Placement(n, t.hosts if not devices else 1, t.platform, t.name, mem, USABLE_MEMORY_FRACTION,
                         tuple(notes))
    platform, kind, n = jax.default_backend(), "", devices or jax.device_count()
    if devices:
        pass
    elif -1 not in sizes and math.prod(sizes) + cfg.mesh.rollout_devices != n:
        # a fixed mesh names its device count (plus the sampler's own, mesh.rollout_devices): plan
        # for it (a plan must not need the devices)
        n = math.prod(sizes) + cfg.mesh.rollout_devices
        notes.append(f"note: planned for the mesh's {n} devices (this machine has {jax.device_count()})")
    else:
        kind = jax.devices()[0].device_kind
    if cfg.mesh.device_memory_gb:
        return Placement(n, 1, platform, kind, cfg.mesh.device_memory_gb, USABLE_MEMORY_FRACTION, tuple(notes))
    if not devices and not notes:
        stats = jax.devices()[0].memory_stats() or {}
        if stats.get("bytes_limit"):  # already the runtime's usable share
            return Placement(n, 1, platform, kind, stats["bytes_limit"] / 1024**3, 1.0, tuple(notes))
    return Placement(n, 1, platform, kind, None, 1.0, tuple(notes))
