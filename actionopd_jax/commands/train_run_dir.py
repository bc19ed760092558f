"""Where `actionopd train` runs, and whether it resumes what is there.

The run directory (--run-dir, run.dir, the newest runs/*-<name> for --resume, or a new one),
the rule that a rerun over finished checkpoints resumes them, and the clean-up that leaves a
directory as it was found when the trainer refuses to start. Kept apart from train.py (the
command's flow) because each is a rule about the directory's state with its own multi-host
care: every process must take the same branch, and only process 0's listing decides.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from actionopd_jax.config import Config, ConfigError

log = logging.getLogger("actionopd_jax.train")   # train.py's log: these lines belong to the run


def run_dir_for(cfg: Config, args) -> Path:
    """--run-dir or run.dir; with --resume the newest runs/*-<name>; else a new, timestamped one
    (process 0's clock, so every process names the same directory)."""
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


def entries(run_dir: Path) -> set[str] | None:
    """The names in `run_dir` before this command wrote anything; None when it did not exist."""
    return set(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else None


def remove_created(run_dir: Path, before: set[str] | None) -> None:
    """Remove what a refused start created in `run_dir` (train.log, checkpoints/, tokenizer/,
    cache/, ...), and the directory itself when this command created it."""
    import shutil

    if not run_dir.is_dir():
        return
    for p in run_dir.iterdir():
        if before is None or p.name not in before:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    if before is None:
        run_dir.rmdir()


def resume_choice(cfg: Config, run_dir: Path, resume):
    """(resume, resumed without being asked). A rerun in a run directory with finished
    checkpoints resumes the latest (after a crash or preemption that is what the user wants;
    a fresh start would collide with the saved steps); `--resume` before the first checkpoint
    was saved starts from step 0."""
    from actionopd_jax.checkpoint import Checkpointer
    from actionopd_jax.train import distributed

    ckpt_dir = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    steps = []
    # Every process must take the same branch: opening a checkpoint manager is collective, and
    # process 0 may already be creating the directory for a fresh run while a slower peer
    # looks (each one's answer is in before any process gets past this gather).
    if distributed.any_process(ckpt_dir.is_dir()):
        ckpt = Checkpointer(ckpt_dir, read_only=True)
        try:
            steps = ckpt.steps()
        finally:
            ckpt.close()
    finished = bool(distributed.broadcast_int(int(bool(steps))))  # process 0's listing decides for all
    if resume is None and finished:
        log.warning("%s holds checkpoints (steps %s): resuming from the latest (use another --run-dir for a "
                    "new run)", ckpt_dir, steps)
        return "latest", True
    if resume == "latest" and not finished:
        log.warning("--resume: no finished checkpoint in %s yet (the run stopped before its first save): "
                    "starting from step 0", ckpt_dir)
        return None, False
    return resume, False
