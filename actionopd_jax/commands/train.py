"""`actionopd train`: run, check, smoke-test or resume a training job.

    actionopd train                   runs the tiny main job on CPU: KD warm start -> ActionOPD -> held-out eval
    actionopd train --config X.yaml   runs a plain training run of X (its collect.kind picks the data),
                                      unless X sets experiment.enabled: true (configs/tiny/tiny_cpu.yaml: the main job)

    actionopd train [--config configs/X.yaml] [section.key=value ...]
                    [--check [--devices N | --target T] [--aot [--lengths L,...]]] [--smoke] [--resume [STEP]] [--force] [--run-dir DIR]

Without --config the embedded defaults are used (the tiny CPU main job, = configs/tiny/tiny_cpu.yaml).
This command chooses what the trainer (actionopd_jax/train, a library) trains on: the group
source of collect.kind and its start-up checks (baselines/wiring.py), or the main job
(actionopd_jax/experiment).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION, take_usable_memory_share
from actionopd_jax.commands.train_run_dir import entries, remove_created, resume_choice, run_dir_for
from actionopd_jax.config import Config, ConfigError
from actionopd_jax.config.load import load_config, replace_keys
from actionopd_jax.train.sources import RunStop, StoppedEarly

log = logging.getLogger("actionopd_jax.train")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actionopd train", description="\n\n".join(__doc__.split("\n\n")[:2]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config of a run (default: the embedded tiny CPU main job)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, applied after the file")
    p.add_argument("--check", action="store_true", help="validate and print the plan; run nothing")
    p.add_argument("--devices", type=int, default=0,
                   help="with --check: plan for this many devices instead of the visible ones")
    p.add_argument("--aot", action="store_true",
                   help="with --check: compile the real train-step programs for the target's devices "
                        "(TPU topologies need the tpu extra's libtpu; no hardware) and print the "
                        "compiler's memory, FLOPs, estimated seconds and MFU")
    p.add_argument("--target", default="",
                   help="with --check: plan for this target's devices (mesh.target; default the config's), "
                        "e.g. h100x1, h200x8, v5p-8, v6e-8; with --aot, compile for them too")
    p.add_argument("--lengths", default="",
                   help="with --aot: sequence buckets to compile, e.g. 8192,32768, or 'all' "
                        "(default: the largest, train.max_seq_len)")
    p.add_argument("--no-cost", action="store_true",
                   help="with --aot: skip the 1- and 2-layer twins that extrapolate the compiler's cost")
    p.add_argument("--smoke", action="store_true",
                   help="one tiny step end to end (train.steps=N on the command line: N), then verify the checkpoint")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="STEP",
                   help="resume the run (latest readable checkpoint, or STEP)")
    p.add_argument("--force", action="store_true", help="resume even if the config changes the experiment")
    p.add_argument("--allow-unverified", action="store_true",
                   help="with --resume: restore a step that has no checksum manifest (refused otherwise)")
    p.add_argument("--run-dir", help="run directory (default: run.dir, else runs/<utc>-<name>; "
                                     "with --resume: the newest runs/*-<name>)")
    return p


SMOKE_OVERRIDES = ("train.steps=1", "checkpoint.every_steps=1", "collect.task_starts_per_step=1",
                   "collect.synthetic.groups_per_step=2", "run.progress=false")


def check(cfg: Config, devices: int = 0) -> int:
    """Validate `cfg` for the hardware it names and print the plan; runs nothing, writes
    nothing. Every start-up check of the run (the trainer's, train/preflight.py, then its group
    source's, baselines/wiring.check_collection) runs here for the target's devices and
    processes: what the run would refuse raises the same ConfigError. 0 when the plan fits, 1
    when the estimate exceeds the usable memory. Planned for this host's own accelerators,
    `model.remat: auto`'s choice is compiled here as the run's start-up compiles it."""
    # before the first device query, as `train` does: on a GPU this host's usable memory is
    # then the run's share (jax's own default is 75%: `--check` planned, and chose remat, for less)
    take_usable_memory_share()
    from actionopd_jax.baselines.wiring import check_collection
    from actionopd_jax.train import remat_choice
    from actionopd_jax.train.plan import describe
    from actionopd_jax.train.preflight import check_run, mesh_sizes, placement
    from actionopd_jax.train.setup import plan_model_config

    remat_choice.refuse_in_main_job(cfg)
    if cfg.experiment.enabled:  # the main job (actionopd_jax/experiment) prints its own plan
        from actionopd_jax.experiment.check import check_main_job

        return check_main_job(cfg, devices)
    from actionopd_jax.train.gpu_lowering import gpu_target as gpu_target_of, lower_if_gpu

    where = placement(cfg, devices)
    gpu_target = gpu_target_of(cfg, devices)  # before anything starts jax's backends
    notes: list[str] = []
    cfg, qcfg = plan_model_config(cfg, notes)
    sizes = mesh_sizes(cfg, where.devices)
    cfg, remat_line = remat_choice.resolve_for(cfg, qcfg, sizes, where)
    check_run(cfg, qcfg, sizes, device_count=where.devices, processes=where.processes, platform=where.platform)
    check_collection(cfg)
    text, fits = describe(cfg, qcfg, sizes, device_memory_gb=where.memory_gib, device_kind=where.device_kind,
                          platform=where.platform, usable_fraction=where.usable_fraction,
                          chips_per_host=where.devices_per_process)
    print(text)
    if remat_line:
        print(remat_line)
        if not (devices or cfg.mesh.target or where.notes) and where.usable_gib:  # planned for this host's devices:
            from actionopd_jax.train.plan import GIB       # compile the choice here, as the run will at start-up
            from actionopd_jax.train.remat_confirm import confirm_for_run

            cfg, confirmed = confirm_for_run(cfg, qcfg, where.usable_gib * GIB)
            if confirmed:
                print(confirmed)
    from actionopd_jax.collect.source import check_training_tasks, prompt_room
    from actionopd_jax.train import cost_estimate

    tasks_line = check_training_tasks(cfg)  # the run's training tasks vs what eval scores
    room_line, first_prompts, source = prompt_room(cfg)      # their first prompts vs collect.max_prompt_tokens
    draws = cfg.collect.kind != "synthetic" and not (cfg.collect.kind == "kd" and cfg.kd.trajectories)
    if draws:  # the budget plus a reply vs the student's own context (issue 43 item 2), measured or not
        from actionopd_jax.envs.prompt_room import context_problem

        c = cfg.collect
        problem = context_problem(c.max_prompt_tokens, c.max_response_tokens, qcfg.max_position_embeddings,
                                  what="collect.max_prompt_tokens", reply_key="collect.max_response_tokens")
        if problem:
            raise ConfigError(problem)
    cost = cost_estimate.describe(cfg, cost_estimate.estimate(cfg, first_prompts), source)
    if cfg.collect.kind == "actionopd":   # issue 44: the mode, eta, and what runs beside the update
        notes = [collection_mode(cfg), *notes]
    for line in (*([tasks_line] if tasks_line else []), *([room_line] if room_line else []), *notes, *where.notes,
                 *missing_secrets(cfg), *cost):
        print(line)
    if not lower_if_gpu(cfg, qcfg, gpu_target):
        print("config valid, but some program of the run does not lower for CUDA (see above)")
        return 1
    if not fits:
        print("config valid, but the plan DOES NOT FIT the usable device memory (see above)")
        return 1
    print("config OK")
    return 0


def collection_mode(cfg: Config) -> str:
    """`--check`'s line on the collection schedule (issue 44): synchronous, or asynchronous with
    its staleness bound and what runs beside the update."""
    eta = cfg.collect.max_staleness
    if not eta:
        return "collect    synchronous (collect.max_staleness=0): each step collects, then updates"
    k = cfg.mesh.rollout_devices
    return (f"collect    asynchronous, collect.max_staleness={eta}: episodes run across updates, a group is trained "
            f"on at most {eta} update(s) after it was sampled (stale ones with the off-policy correction); "
            + (f"the sampler decodes on its own {k} device(s) (mesh.rollout_devices) while the update runs on the "
               "others" if k else "beside the update run the sampler's own copy of the weights and its KV cache"))


def missing_secrets(cfg: Config) -> list[str]:
    """A `--check` line per API key the run will read from an environment variable that is not
    set here (a planning host need not hold them; the run refuses to start without them)."""
    wanted = []
    if cfg.collect.kind != "synthetic" and not (cfg.collect.kind == "kd" and cfg.kd.trajectories):
        wanted += [("teacher", cfg.teacher.api_key_env if cfg.teacher.kind == "openai" else ""),
                   ("matcher", cfg.matcher.api_key_env if cfg.matcher.kind != "rules" else ""),
                   ("user simulator", cfg.env.user_api_key_env)]
    users: dict[str, list[str]] = {}
    for who, var in wanted:
        if var and not os.environ.get(var):
            users.setdefault(var, []).append(who)
    return [f"secrets    {var} (the {' and '.join(who)} API key) is not set in this environment: export it "
            "before the run" for var, who in users.items()]


def check_aot(cfg: Config, target: str, lengths: str = "", cost: bool = True) -> int:
    """Compile the run's train-step programs for `target`; 0 when all fit the usable HBM."""
    from actionopd_jax.aot.targets import TARGETS, TargetUnavailable
    from actionopd_jax.train.aot_check import run_check
    from actionopd_jax.train.setup import model_config

    if not target:
        raise ConfigError(f"--aot needs a target: set mesh.target in the config or pass --target "
                          f"(one of {', '.join(TARGETS)})")
    if target not in TARGETS:
        raise ConfigError(f"unknown --aot target {target!r}; known: {', '.join(TARGETS)}")
    if cfg.model.hf_path and not (Path(cfg.model.hf_path) / "config.json").is_file():
        cfg = replace_keys(cfg, **{"model.hf_path": ""})   # same shapes from the preset (noted by check)
    if cfg.model.remat == "auto":  # compile the policy the plan chose (printed by --check above)
        from actionopd_jax.train import remat_choice
        from actionopd_jax.train.preflight import mesh_sizes, placement

        where = placement(cfg)
        cfg, line = remat_choice.resolve_for(cfg, model_config(cfg), mesh_sizes(cfg, where.devices), where)
        print(f"AOT compiles {line.split('-> ')[1].split(':')[0]} remat (model.remat=auto's choice)")
    try:
        fits = run_check(cfg, model_config(cfg), target, lengths, cost=cost)
    except TargetUnavailable as e:
        print(f"AOT: {e}")
        return 2
    share = f"{100 * USABLE_MEMORY_FRACTION:.0f}% of HBM"
    print(f"AOT OK: every program compiled and fits in {share}" if fits else
          f"AOT: some program does not compile or needs more than {share} (see the table)")
    return 0 if fits else 1


def train(cfg: Config, args) -> int:
    from actionopd_jax.compile_cache import enable_compile_cache, off_for_cpu_cluster

    take_usable_memory_share()   # before the first device query (also called by `actionopd`'s main)
    enable_compile_cache(cfg.run.compile_cache_dir)
    from actionopd_jax.train import remat_choice

    remat_choice.refuse_in_main_job(cfg)
    if cfg.experiment.enabled and not args.smoke:  # the main job: KD -> ActionOPD -> evaluation
        from actionopd_jax.experiment.job import run_main_job

        return run_main_job(cfg, args)
    import functools

    from actionopd_jax.baselines.wiring import build_source
    from actionopd_jax.train import distributed
    from actionopd_jax.train.loop import Trainer
    from actionopd_jax.train.reporting import setup_logging, write_config

    distributed.initialize(cfg.run.distributed)
    cache_note = off_for_cpu_cluster()
    if cfg.model.remat == "auto":  # chosen as --check chose it, from this host's devices
        from actionopd_jax.train.plan import GIB
        from actionopd_jax.train.preflight import mesh_sizes, placement
        from actionopd_jax.train.remat_confirm import confirm_for_run
        from actionopd_jax.train.setup import plan_model_config

        where = placement(cfg)
        qcfg = plan_model_config(cfg, [])[1]
        cfg, remat_line = remat_choice.resolve_for(cfg, qcfg, mesh_sizes(cfg, where.devices), where)
        print(remat_line, flush=True)
        # the plan's choice, compiled on these devices before anything is collected: a policy
        # XLA puts over the usable memory steps down to the next (train/remat_confirm.py)
        cfg, confirmed = confirm_for_run(cfg, qcfg, where.usable_gib and where.usable_gib * GIB)
        if confirmed:
            print(confirmed, flush=True)
    run_dir = run_dir_for(cfg, args)
    primary = distributed.is_primary()
    before = entries(run_dir)
    import jax

    setup_logging(run_dir, primary=primary, process_index=jax.process_index())
    log.info("run directory %s; process %d of %d, %d local / %d global devices", run_dir,
             jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
    if cache_note:
        log.info(cache_note)
    resume = None if args.resume is None else (args.resume if args.resume == "latest" else int(args.resume))
    resume, auto = resume_choice(cfg, run_dir, resume)
    try:
        trainer = Trainer(cfg, run_dir=run_dir, source=functools.partial(build_source, cfg), resume=resume,
                          force=args.force, allow_unverified=args.allow_unverified)
    except BaseException as e:
        if primary:  # a refused start leaves the run directory as it found it
            setup_logging(None, primary=primary, process_index=jax.process_index())
            remove_created(run_dir, before)
        if auto and isinstance(e, ConfigError):  # the user did not ask to resume: say why this run is resumed
            raise ConfigError(f"{run_dir} already holds checkpoints, so this command resumes that run, but {e}\n"
                              f"(or pass another --run-dir to start a new run)") from e
        raise
    if primary:  # only once the run is accepted: a refused resume leaves the run's config as it was
        write_config(run_dir, cfg.to_yaml())
        if args.smoke and not (cfg.model.tokenizer or cfg.model.hf_path):
            _record_smoke_tokenizer(trainer)
    first = trainer.step
    try:
        code = trainer.run()
        if trainer.stop_message:
            print(f"actionopd train: stopped: {trainer.stop_message}", file=sys.stderr)
        if primary:
            _print_spend(trainer.run_dir)
        if args.smoke:
            code = code or _verify_smoke(trainer, trained=trainer.step - first)
    finally:
        trainer.close()
    return code


def _print_spend(run_dir: Path) -> None:
    """What the remote models cost this run so far (spend.md + spend.png, and the table), and
    what asynchronous collection did (async.md + async.png, for collect.max_staleness >= 1)."""
    from actionopd_jax.train.spend_report import write_spend_report

    report = write_spend_report(run_dir)
    if report["table"]:
        print(f"what the remote models cost (resumes included; {report['markdown']}, {report['png']}):\n"
              f"{report['table']}")
    from actionopd_jax.train.async_report import write_async_report

    report = write_async_report(run_dir)
    if report["table"]:   # collect.max_staleness >= 1 (issue 44)
        print(f"asynchronous collection (resumes included; {report['markdown']}, {report['png']}):\n"
              f"{report['table']}")


def _record_smoke_tokenizer(trainer) -> None:
    """A smoke run of a random-init model names no tokenizer (its groups are synthetic): record
    the offline tiny tokenizer, so eval, serve and export load the run like any other."""
    from actionopd_jax.chat import build_tiny_tokenizer
    from actionopd_jax.checkpoint.run import TOKENIZER_DIR

    vocab = min(2048, trainer.qcfg.vocab_size)
    try:
        out = build_tiny_tokenizer(trainer.run_dir / TOKENIZER_DIR, vocab_size=vocab)
    except ValueError as e:  # a model vocabulary too small for any byte-level tokenizer
        log.warning("smoke run: no tokenizer recorded (%s); eval and serve will need --tokenizer", e)
        return
    log.info("smoke run: recorded the offline tiny tokenizer (%d ids) in %s", vocab, out)


def _verify_smoke(trainer, *, trained: int) -> int:
    """Restore what the smoke step saved and compare it with the live parameters; `trained`:
    the steps this command trained (0 when a resumed run had nothing left)."""
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
    did = (f"{trained} step(s) trained" if trained else
           f"nothing left to train (the run was already at step {trainer.step} of train.steps={trainer.cfg.train.steps})")
    print(f"smoke OK: {did}, checkpoint {restored.step} restored identically ({trainer.run_dir})")
    return 0


def _refuse_compare_preset(path: str | None) -> None:
    """A compare preset (a top-level compare: section) is `actionopd compare`'s; `train` said only
    "unknown config key 'compare'" (issue 43 item 6)."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text()) if path and Path(path).is_file() else None
    except yaml.YAMLError:
        return  # the loader reports it
    if isinstance(raw, dict) and "compare" in raw:
        raise ConfigError(f"{path} is a compare preset (its compare: section is not a run-config section): check it "
                          f"with `actionopd compare --config {path} --check` and run it with `actionopd compare "
                          f"--config {path}`")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.resume not in (None, "latest") and not str(args.resume).isdigit():
            raise ConfigError(f"--resume takes a step number, got {args.resume!r}")
        # the user's overrides come last: `--smoke train.steps=2` trains two steps
        overrides = (list(SMOKE_OVERRIDES) if args.smoke else []) + list(args.overrides)
        _refuse_compare_preset(args.config)
        cfg = load_config(args.config, overrides)
        if args.aot and not args.check:
            raise ConfigError("--aot is a mode of --check: actionopd train --check --aot ...")
        if (args.lengths or args.no_cost) and not args.aot:   # else silently ignored
            raise ConfigError("--lengths and --no-cost are options of --aot: actionopd train --check --aot ...")
        if args.devices and not args.check:
            raise ConfigError("--devices is an option of --check: actionopd train --check --devices N")
        if args.target:  # plan (and with --aot compile) for this target: a plan for other devices is a wrong answer
            from actionopd_jax.aot.targets import TARGETS

            if not args.check:
                raise ConfigError("--target is a mode of --check: actionopd train --check --target T [--aot] ...")
            if args.target not in TARGETS:
                raise ConfigError(f"unknown --target {args.target!r}; known: {', '.join(TARGETS)}")
            cfg = replace_keys(cfg, **{"mesh.target": args.target})
        if args.check:
            code = check(cfg, args.devices)
            if code in (0, 1) and args.aot:  # valid: the compiler's verdict replaces the estimate's
                code = check_aot(cfg, args.target or cfg.mesh.target, args.lengths, cost=not args.no_cost)
            return code
        return train(cfg, args)
    except ConfigError as e:
        print(f"actionopd train: config error: {e}", file=sys.stderr)
        return 2
    except RunStop as e:
        print(f"actionopd train: stopped: {e}", file=sys.stderr)
        return 1
    except StoppedEarly as e:   # a phase's trainer stopped on SIGTERM / its budget, state saved
        print(f"actionopd train: {e}", file=sys.stderr)
        return e.code
    except FileNotFoundError as e:
        print(f"actionopd train: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from actionopd_jax.checkpoint import CheckpointError

        if isinstance(e, CheckpointError):
            print(f"actionopd train: checkpoint error: {e}", file=sys.stderr)
            return 2
        raise
