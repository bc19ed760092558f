"""The checks a run makes before it starts, one set of functions for the run and `--check`.

`Trainer` and `build_mesh` call these with the devices the run has; `actionopd train --check`
calls the same functions with the devices of the config's target (`mesh.target`), so a
config the run would refuse is refused by the check with the same message.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION
from actionopd_jax.config import Config, ConfigError


def mesh_sizes(cfg: Config, device_count: int) -> dict[str, int]:
    """Resolve the -1 axis against `device_count`; errors say what does not divide."""
    sizes = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
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


def check_collection(cfg: Config) -> None:
    """The offline part of what the group source reads from the config when the run builds it
    (collect/source.py, baselines/wiring.py): its settings, the teacher and matcher specs, the
    task sets (loaded, so missing data or a refused split shows here) and the user simulator.
    Not the tokenizer or checkpoint files, which a planning host may not hold."""
    kind, teacher = cfg.collect.kind, cfg.teacher.kind
    if kind == "synthetic":
        return
    from actionopd_jax.collect import source
    from actionopd_jax.envs.registry import env_factory_from
    from actionopd_jax.teacher.specs import judge_spec, teacher_spec

    if kind == "kd":
        from actionopd_jax.baselines import kd, wiring

        if cfg.kd.trajectories:
            kd.load_trajectories(cfg.kd.trajectories, min_reward=cfg.kd.min_reward)
        else:  # the teacher runs first, on the training tasks
            wiring.endpoint_agent(cfg)
            wiring.tasks_from_env(cfg, limit=cfg.kd.max_tasks)
            env_factory_from(cfg.env)
        return
    try:
        source.collector_config_from(cfg)
    except ValueError as e:
        raise e if isinstance(e, ConfigError) else ConfigError(f"collect: {e}") from None
    if kind == "actionopd" and teacher != "self":
        teacher_spec(cfg.teacher)
        judge_spec(cfg.matcher)
    source.train_task_stream(cfg)
    env_factory_from(cfg.env)


def check_run(cfg: Config, qcfg, sizes: dict[str, int], *, device_count: int, processes: int,
              platform: str, collection: bool = True) -> None:
    """Every start-up check that depends on the config and the devices, in the run's order
    (`collection=False`: the main job, whose phases build their sources from the job's split)."""
    from actionopd_jax.train.setup import check_attention

    check_mesh_covers_processes(sizes, device_count, processes)
    check_batch_layout(cfg, sizes, processes)
    check_attention(cfg, qcfg, platform)
    if collection:
        check_collection(cfg)


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
    elif -1 not in sizes and math.prod(sizes) != n:
        # a fixed mesh names its device count: plan for it (a plan must not need the devices)
        n = math.prod(sizes)
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


def plan_model_config(cfg: Config, notes: list[str]):
    """(cfg, Qwen3Config) for a plan: without the checkpoint on this machine, the preset has
    the same shapes (noted)."""
    from actionopd_jax.train.setup import model_config

    if cfg.model.hf_path and not (Path(cfg.model.hf_path) / "config.json").is_file():
        notes.append(f"note: {cfg.model.hf_path}/config.json not found; planned with preset {cfg.model.preset!r}")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=""))  # a path: nothing to re-check
    return cfg, model_config(cfg)
