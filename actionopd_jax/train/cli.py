"""`actionopd train`: run, check, smoke-test or resume a training job.

    actionopd train [--config configs/X.yaml] [section.key=value ...]
                    [--check [--devices N]] [--smoke] [--resume [STEP]] [--force] [--run-dir DIR]

Without --config the embedded defaults are used (the tiny CPU job, = configs/tiny_cpu.yaml).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from actionopd_jax.config import Config, ConfigError, load_config

log = logging.getLogger("actionopd_jax.train")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actionopd train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML config (default: the embedded tiny CPU job)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, applied after the file")
    p.add_argument("--check", action="store_true", help="validate and print the plan; run nothing")
    p.add_argument("--devices", type=int, default=0,
                   help="with --check: plan for this many devices instead of the visible ones")
    p.add_argument("--smoke", action="store_true", help="one tiny step end to end, then verify the checkpoint")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="STEP",
                   help="resume the run (latest readable checkpoint, or STEP)")
    p.add_argument("--force", action="store_true", help="resume even if the config changes the experiment")
    p.add_argument("--run-dir", help="run directory (default: run.dir, else runs/<utc>-<name>; "
                                     "with --resume: the newest runs/*-<name>)")
    return p


SMOKE_OVERRIDES = ("train.steps=1", "checkpoint.every_steps=1", "collect.task_starts_per_step=1",
                   "collect.synthetic.groups_per_step=2", "run.progress=false")


def check(cfg: Config, devices: int = 0) -> int:
    import math

    import jax

    from actionopd_jax.train.plan import describe
    from actionopd_jax.train.setup import mesh_shape, model_config

    if cfg.experiment.enabled:  # the main job (actionopd_jax/experiment) prints its own plan
        from actionopd_jax.experiment.check import check_main_job

        return check_main_job(cfg, devices)
    n = devices or jax.device_count()
    kind = "" if devices else jax.devices()[0].device_kind
    sizes = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    mesh_note = ""
    if not devices and -1 not in sizes and math.prod(sizes) != n:
        # a fixed mesh names its device count: plan for it (a plan must not need the devices)
        n, kind = math.prod(sizes), ""
        mesh_note = f"note: planned for the mesh's {n} devices (this machine has {jax.device_count()})"
    mem = cfg.mesh.device_memory_gb or None
    if mem is None and not devices and not mesh_note:
        stats = jax.devices()[0].memory_stats() or {}
        if stats.get("bytes_limit"):
            mem = stats["bytes_limit"] / 1024**3
    note = ""
    if cfg.model.hf_path and not (Path(cfg.model.hf_path) / "config.json").is_file():
        # planning on a machine without the weights: the preset has the same shapes
        note = f"note: {cfg.model.hf_path}/config.json not found; planned with preset {cfg.model.preset!r}"
        cfg = cfg.replace(**{"model.hf_path": ""})
    text, fits = describe(cfg, model_config(cfg), mesh_shape(cfg, n), device_memory_gb=mem, device_kind=kind)
    print(text)
    for line in (note, mesh_note):
        if line:
            print(line)
    print("config OK" + ("" if fits else " (but the estimate exceeds device memory)"))
    return 0


def _run_dir(cfg: Config, args) -> Path:
    from actionopd_jax.train import distributed
    from actionopd_jax.train.reporting import latest_run_dir, new_run_dir

    if args.run_dir or cfg.run.dir:
        return Path(args.run_dir or cfg.run.dir)
    if args.resume is not None:
        found = latest_run_dir(cfg.run.root, cfg.run.name)
        if found is None:
            raise ConfigError(f"--resume: no run directory {cfg.run.root}/*-{cfg.run.name}; pass --run-dir")
        return found
    name = cfg.run.name + ("-smoke" if args.smoke else "")
    return new_run_dir(cfg.run.root, name, distributed.broadcast_int(int(time.time())))


def train(cfg: Config, args) -> int:
    if cfg.experiment.enabled and not args.smoke:  # the main job: KD -> ActionOPD -> evaluation
        from actionopd_jax.experiment.job import run_main_job

        return run_main_job(cfg, args)
    from actionopd_jax.train import distributed
    from actionopd_jax.train.loop import Trainer
    from actionopd_jax.train.reporting import setup_logging, write_config

    distributed.initialize(cfg.run.distributed)
    run_dir = _run_dir(cfg, args)
    primary = distributed.is_primary()
    import jax

    setup_logging(run_dir, primary=primary, process_index=jax.process_index())
    if primary:
        write_config(run_dir, cfg.to_yaml())
    log.info("run directory %s; process %d of %d, %d local / %d global devices", run_dir,
             jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
    resume = None if args.resume is None else (args.resume if args.resume == "latest" else int(args.resume))
    trainer = Trainer(cfg, run_dir=run_dir, resume=resume, force=args.force)
    try:
        code = trainer.run()
        if args.smoke:
            code = code or _verify_smoke(trainer)
    finally:
        trainer.close()
    return code


def _verify_smoke(trainer) -> int:
    """Restore what the smoke step saved and compare it with the live parameters."""
    import jax
    import numpy as np

    from actionopd_jax.train.loop import host_scalar

    restored = trainer.ckpt.restore(trainer.step_fn.abstract_state(), trainer.step)
    diffs = jax.tree.map(lambda a, b: jax.numpy.max(jax.numpy.abs(a - b)), restored.params,
                         trainer.state["params"])
    worst = max(host_scalar(d) for d in jax.tree.leaves(diffs))
    if worst != 0.0 or not np.isfinite(worst):
        print(f"smoke FAILED: restored parameters differ from the trained ones by {worst}", file=sys.stderr)
        return 1
    print(f"smoke OK: {trainer.step} step(s) trained, checkpoint {restored.step} restored identically "
          f"({trainer.run_dir})")
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.resume not in (None, "latest") and not str(args.resume).isdigit():
            raise ConfigError(f"--resume takes a step number, got {args.resume!r}")
        overrides = list(args.overrides) + (list(SMOKE_OVERRIDES) if args.smoke else [])
        cfg = load_config(args.config, overrides)
        if args.check:
            return check(cfg, args.devices)
        return train(cfg, args)
    except ConfigError as e:
        print(f"actionopd train: config error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"actionopd train: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from actionopd_jax.train.checkpoint import CheckpointError

        if isinstance(e, CheckpointError):
            print(f"actionopd train: checkpoint error: {e}", file=sys.stderr)
            return 2
        raise
