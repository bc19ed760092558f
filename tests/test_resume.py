"""Re-running a training command (issue 16 item 3): a run directory with checkpoints resumes
(after a crash or preemption), a changed config is refused with the reason, `--resume` before
the first checkpoint starts from step 0, and the main job refuses a used run directory before
any phase runs. `actionopd train` runs in process (the plain trainer on the synthetic source)."""

import argparse
import functools
import json
import logging

import pytest

from actionopd_jax.config import Config, ConfigError
from actionopd_jax.config.load import replace_keys
from actionopd_jax.commands import train as train_cli
from actionopd_jax.checkpoint import Checkpointer, CheckpointError
from actionopd_jax.train.loop import Trainer
from actionopd_jax.train.sources import synthetic_source

COMMON = ["experiment.enabled=false", "run.progress=false", "run.tensorboard=false",
          "collect.synthetic.groups_per_step=2", "checkpoint.async_save=false"]


@pytest.fixture(autouse=True)
def _restore_logging():
    """`actionopd train` installs its own log handlers; give pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)


def _train(run_dir, *extra):
    return train_cli.main(["--run-dir", str(run_dir), *COMMON, *extra])


def _metric_steps(run_dir):
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _steps(run_dir):
    ckpt = Checkpointer(run_dir / "checkpoints", read_only=True)
    try:
        return ckpt.steps()
    finally:
        ckpt.close()


def test_rerun_in_a_run_dir_with_checkpoints_resumes_and_a_changed_config_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(run, "train.steps=1") == 0
    # the same command again, now asking for 2 steps (as after a crash at step 1): it resumes
    assert _train(run, "train.steps=2") == 0
    assert _metric_steps(run) == [1, 2] and _steps(run) == [1, 2]
    assert "resumed from step 1" in (run / "train.log").read_text()
    assert "resuming from the latest" in (run / "train.log").read_text()

    written = (run / "config.yaml").read_text()
    assert _train(run, "train.steps=3", "train.lr=1e-5") == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints, so this command resumes that run" in err
    assert "train.lr: 1e-06 -> 1e-05" in err and "--force" in err and "--run-dir" in err
    assert (run / "config.yaml").read_text() == written  # a refused run leaves the run's config alone
    assert _steps(run) == [1, 2]


def test_resume_before_the_first_checkpoint_starts_from_step_0(tmp_path):
    run = tmp_path / "run"
    # what a kill during the first step leaves: the run directory, its log, no finished step
    (run / "checkpoints" / "1.orbax-checkpoint-tmp-1733000000").mkdir(parents=True)
    (run / "train.log").write_text("")
    assert _train(run, "train.steps=1", "--resume") == 0
    assert _metric_steps(run) == [1] and _steps(run) == [1]
    assert "stopped before its first save): starting from step 0" in (run / "train.log").read_text()


def test_a_fresh_trainer_refuses_a_checkpoint_dir_it_would_collide_with(tmp_path):
    cfg = replace_keys(Config(), **{"experiment.enabled": False, "run.progress": False, "run.tensorboard": False,
                                    "collect.synthetic.groups_per_step": 2, "train.steps": 1})
    trainer = Trainer(cfg, run_dir=tmp_path, source=functools.partial(synthetic_source, cfg))
    try:
        assert trainer.run() == 0
    finally:
        trainer.close()
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(steps \[1\]\).*--resume"):
        Trainer(cfg, run_dir=tmp_path, source=functools.partial(synthetic_source, cfg))


def test_main_job_refuses_a_used_run_dir_before_any_phase(tmp_path):
    from actionopd_jax.experiment.job import run_dir_for

    args = argparse.Namespace(run_dir=str(tmp_path), resume=None)
    assert run_dir_for(Config(), args) == tmp_path  # an empty directory is fine
    (tmp_path / "warm_start").mkdir()
    with pytest.raises(ConfigError, match="already holds a main-job run .*pass a new --run-dir"):
        run_dir_for(Config(), args)
