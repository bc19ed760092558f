"""Building the pieces of a run from its config: model config, mesh, parameters, train step."""

from __future__ import annotations

import dataclasses

import logging
import math
from pathlib import Path

import jax
from flax import nnx

from actionopd_jax.config import Config, ConfigError
from actionopd_jax.model import PRESETS, Qwen3, Qwen3Config, make_mesh, param_shardings
from actionopd_jax.model.runtime import RuntimeOptions
from actionopd_jax.train.preflight import (check_attention, check_mesh_covers_processes, check_rollout_split,
                                           mesh_sizes)
from actionopd_jax.train.step import StepSettings, TrainStep, make_optimizer, split_params
from actionopd_jax.jax_compat import set_mesh

log = logging.getLogger(__name__)


def model_config(cfg: Config, saved_hf_dict: dict | None = None) -> Qwen3Config:
    """The student's Qwen3Config (its shape and parameter dtype): from a checkpoint's record,
    the HF config.json, or a preset. How it runs is `runtime_options(cfg)`."""
    m = cfg.model
    over = dict(param_dtype=m.param_dtype)
    if saved_hf_dict is not None:
        return Qwen3Config.from_hf_dict(saved_hf_dict, **over)
    if m.hf_path:
        return Qwen3Config.from_hf_json(m.hf_path, **over)
    if m.preset not in PRESETS:
        raise ConfigError(f"model.preset={m.preset!r} is not a known preset; choose one of "
                          f"{sorted(PRESETS)} or set model.hf_path")
    return PRESETS[m.preset].replace(**over)


def runtime_options(cfg: Config) -> RuntimeOptions:
    """The student's execution settings: model.dtype / remat / attention / scan_unroll."""
    return RuntimeOptions.from_section(cfg.model)


def mesh_shape(cfg: Config, device_count: int) -> dict[str, int]:
    """Resolve the -1 axis against `device_count` (train/preflight.mesh_sizes)."""
    return mesh_sizes(cfg, device_count)


def rollout_devices(cfg: Config) -> tuple:
    """The devices the sampler's rollout copy goes to: () = every local device, shared with
    training (mesh.rollout_devices = 0); else the last k of this host's devices, the training
    mesh being built on the others (`build_mesh`)."""
    k = cfg.mesh.rollout_devices
    if not k:
        return ()
    check_rollout_split(cfg, jax.process_count())
    mesh_shape(cfg, jax.device_count())   # the split's own refusals, before any device is used
    return tuple(jax.devices()[-k:])


def build_mesh(cfg: Config):
    """The training mesh: the first prod(mesh sizes) devices (with mesh.rollout_devices = k,
    exactly the first D - k; the sampler's are `rollout_devices(cfg)`)."""
    check_rollout_split(cfg, jax.process_count())
    shape = mesh_shape(cfg, jax.device_count())
    used = math.prod(shape.values())
    check_mesh_covers_processes(shape, jax.device_count(), jax.process_count())
    if cfg.mesh.rollout_devices:
        log.info("mesh %s trains on the first %d of the %d devices; the sampler has the last %d "
                 "(mesh.rollout_devices)", shape, used, jax.device_count(), cfg.mesh.rollout_devices)
    elif used < jax.device_count():
        log.warning("mesh %s uses %d of the %d devices", shape, used, jax.device_count())
    if cfg.mesh.target:
        from actionopd_jax.aot.targets import get_target

        t = get_target(cfg.mesh.target)
        if t.platform == jax.devices()[0].platform and t.chips != jax.device_count():
            log.warning("mesh.target %s has %d chips but this run has %d devices: `train --check` planned "
                        "for the target, not for these devices", t.name, t.chips, jax.device_count())
    return make_mesh(shape)


def abstract_model(qcfg: Qwen3Config, runtime: RuntimeOptions | None = None):
    """(graphdef, abstract pure-dict params) without allocating anything."""
    return split_params(nnx.eval_shape(lambda: Qwen3(qcfg, runtime=runtime, rngs=nnx.Rngs(0))))


def initial_params(cfg: Config, qcfg: Qwen3Config, mesh) -> dict:
    """Starting weights on the mesh: the HF checkpoint, or a seeded random init made
    directly in its sharded layout (no full copy on one device)."""
    if cfg.model.hf_path:
        from actionopd_jax.model.weights import load_hf

        _, model = load_hf(cfg.model.hf_path, cfg_overrides=dict(param_dtype=qcfg.param_dtype),
                           runtime=runtime_options(cfg), mesh=mesh)
        return split_params(model)[1]
    abstract = nnx.eval_shape(lambda: Qwen3(qcfg, rngs=nnx.Rngs(0)))
    shardings = nnx.to_pure_dict(param_shardings(nnx.state(abstract, nnx.Param), mesh))
    seed = cfg.model.init_seed

    def init():
        return split_params(Qwen3(qcfg, rngs=nnx.Rngs(seed)))[1]

    with set_mesh(mesh):
        return jax.jit(init, out_shardings=shardings)()


def step_settings(cfg: Config) -> StepSettings:
    """The update's settings. Log-probs are taken at the rollout temperature (the policy the
    student sampled from: the ActionOPD and OPD ratios need it), except KD's, which is plain
    imitation of the teacher's tokens (paper B.4): cross-entropy at T=1."""
    t = cfg.train
    temperature = 1.0 if t.loss == "kd" else cfg.collect.temperature
    return StepSettings(loss=t.loss, temperature=temperature, clip_eps=t.clip_eps,
                        dual_clip=t.dual_clip, logits_chunk=t.logits_chunk,
                        vocab_chunk=t.vocab_chunk,
                        shared_prompt=cfg.collect.num_candidates if t.shared_prompt else 0)


def optimizer(cfg: Config):
    t = cfg.train
    return make_optimizer(lr=t.lr, weight_decay=t.weight_decay, b1=t.adam_b1, b2=t.adam_b2,
                          eps=t.adam_eps, grad_clip=t.grad_clip, warmup_steps=t.warmup_steps)


def build_train_step(cfg: Config, qcfg: Qwen3Config, mesh, runtime: RuntimeOptions | None = None) -> TrainStep:
    """runtime: the model's execution settings (None: the run's, `runtime_options(cfg)`)."""
    from actionopd_jax.model.attention import target_platform

    check_attention(cfg, qcfg, target_platform(mesh))  # the traced-for platform (aot.lowering_for)
    graphdef, abstract = abstract_model(qcfg, runtime_options(cfg) if runtime is None else runtime)
    return TrainStep(graphdef, abstract, mesh, optimizer(cfg), step_settings(cfg))


def plan_model_config(cfg: Config, notes: list[str]):
    """(cfg, Qwen3Config) for a plan: without the checkpoint on this machine, the preset has
    the same shapes (noted)."""
    if cfg.model.hf_path and not (Path(cfg.model.hf_path) / "config.json").is_file():
        notes.append(f"note: {cfg.model.hf_path}/config.json not found; planned with preset {cfg.model.preset!r}")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=""))  # a path: nothing to re-check
    return cfg, model_config(cfg)
