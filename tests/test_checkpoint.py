"""Checkpoints of the training loop: resume on another mesh or device count, corrupt and
partial checkpoints, config changes on resume, SIGTERM, and `actionopd export`.

The data come from the synthetic group source, which stands in for the collector (the
trainer sees the same StateGroup records, derived deterministically from (seed, step)).
"""

import functools
import logging
import os
import shutil
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from actionopd_jax.config import Config, ConfigError
from actionopd_jax.config.load import replace_keys
from actionopd_jax.checkpoint import Checkpointer, CheckpointError
from actionopd_jax.train.loop import SIGTERM_EXIT_CODE, Trainer
from actionopd_jax.train.sources import synthetic_source
from tests._train_fixtures import max_abs_diff, to_host

MESH_222 = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
# a learning rate that moves the weights visibly, so "same parameters" is a real check; every
# run on the reference's mesh unless a test says otherwise, so that the runs' steps (the same
# data and shapes) are the reference's programs, compiled once, not a compile per mesh
BASE = {"train.lr": 1e-3, "train.adam_eps": 1e-3, "run.progress": False, "run.tensorboard": False,
        "collect.synthetic.groups_per_step": 3, "checkpoint.async_save": True, **MESH_222}


def cfg_with(**kw) -> Config:
    return replace_keys(Config(), **{**BASE, **kw})


def synthetic(cfg):
    return functools.partial(synthetic_source, cfg)


def run(cfg, run_dir, **kw) -> Trainer:
    kw.setdefault("source", synthetic(cfg))
    trainer = Trainer(cfg, run_dir=run_dir, **kw)
    try:
        assert trainer.run() == 0
    finally:
        trainer.close()
    return trainer


def params_at(run_dir, step=None):
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", read_only=True)
    try:
        r = ckpt.restore(None, step, params_only=True)
    finally:
        ckpt.close()
    return r.step, to_host(r.params)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted 3 steps on a (2, 2, 2) mesh."""
    d = tmp_path_factory.mktemp("reference")
    run(cfg_with(**MESH_222, **{"train.steps": 3}), d)
    return d


@pytest.mark.parametrize("mesh", [{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2},
                                  {"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}],
                         ids=["4x2", "one-device"])
def test_resume_on_another_mesh_continues_the_same_run(reference, tmp_path, mesh):
    # the reference's own first two steps (the same config, mesh and seed) stand for a run
    # stopped after step 2: copied with step 3 removed, not trained again
    first = tmp_path / "run"
    shutil.copytree(reference, first)
    shutil.rmtree(first / "checkpoints" / "3")
    assert params_at(first)[0] == 2
    resumed = run(cfg_with(**mesh, **{"train.steps": 3}), first, resume="latest")
    assert resumed.step == 3
    assert resumed.mesh.devices.size == mesh["mesh.fsdp"] * mesh["mesh.tensor"]
    step, got = params_at(first)
    _, want = params_at(reference)
    assert step == 3
    assert max_abs_diff(got, want) < 1e-5  # float reordering across meshes only
    # and the weights did move: the comparison is not trivially true
    _, at2 = params_at(first, 2)
    assert max_abs_diff(want, at2) > 1e-4


def test_corrupt_latest_checkpoint_falls_back_with_a_clear_error(reference, tmp_path, caplog):
    d = tmp_path / "run"
    run(cfg_with(**{"train.steps": 2}), d)
    manifest = d / "checkpoints" / "2" / "params" / "manifest.ocdbt"
    manifest.write_bytes(b"garbage")
    ckpt = Checkpointer(d / "checkpoints")
    with caplog.at_level(logging.ERROR):
        r = ckpt.restore(None)
    assert r.step == 1 and "checkpoint step 2" in caplog.text and "unreadable" in caplog.text
    with pytest.raises(CheckpointError, match="checkpoint step 2 .* is unreadable"):
        ckpt.restore(None, 2)
    with pytest.raises(CheckpointError, match=r"step 7 is not in .*available steps: \[1, 2\]"):
        ckpt.restore(None, 7)
    ckpt.close()
    # the trainer resumes from step 1 and redoes step 2
    resumed = run(cfg_with(**{"train.steps": 2}), d, resume="latest")
    assert resumed.step == 2


def test_interrupted_save_leaves_no_usable_step(tmp_path, monkeypatch):
    d = tmp_path / "run"
    run(cfg_with(**{"train.steps": 1}), d)
    # what a crash in the middle of an Orbax save leaves behind: a temporary step directory
    partial = d / "checkpoints" / "2.orbax-checkpoint-tmp-1234"
    (partial / "params").mkdir(parents=True)
    rmtree = shutil.rmtree

    def slow_rmtree(path, *a, **k):   # a loaded machine: Orbax's background removal lags
        time.sleep(0.5)
        return rmtree(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    ckpt = Checkpointer(d / "checkpoints")
    assert ckpt.steps() == [1]
    ckpt.close()
    # closed means its removal of the partial save is over: a resume opening the folder next
    # raced Orbax's background removal, and one of the two removals failed in a full suite
    assert not partial.exists()
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert run(cfg_with(**{"train.steps": 2}), d, resume="latest").step == 2


def test_resume_refuses_an_experiment_change_unless_forced(tmp_path):
    d = tmp_path / "run"
    run(cfg_with(**{"train.steps": 1}), d)
    changed = cfg_with(**{"train.steps": 2, "collect.freq_bonus": 0.25})
    with pytest.raises(ConfigError, match=r"(?s)collect.freq_bonus: 0.5 -> 0.25.*--force"):
        Trainer(changed, run_dir=d, source=synthetic(changed), resume="latest")
    assert run(changed, d, resume="latest", force=True).step == 2
    # the forced config is now the run's; a layout change on top of it is not an experiment change
    relaid = replace_keys(changed, **{"train.steps": 3, "train.microbatch_rows": 16, "mesh.fsdp": 2, "mesh.data": 4,
                                     "mesh.tensor": 1})
    assert run(relaid, d, resume="latest").step == 3


def test_no_checkpoint_to_resume(tmp_path):
    with pytest.raises(CheckpointError, match="no finished checkpoint"):
        Trainer(cfg_with(), run_dir=tmp_path, source=synthetic(cfg_with()), resume="latest")


class _TermDuringCollect:
    """Wraps the synthetic source and sends this process SIGTERM while collecting step 1,
    as a TPU/Spot preemption notice would arrive in the middle of a step."""

    def __init__(self, inner):
        self.inner = inner

    def collect(self, step, policy):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.inner.collect(step, policy)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, s):
        self.inner.load_state_dict(s)


def test_sigterm_finishes_the_step_saves_and_exits(tmp_path):
    from actionopd_jax.train.sources import SyntheticGroupSource

    cfg = cfg_with(**{"train.steps": 5, "checkpoint.every_steps": 10})
    src = _TermDuringCollect(SyntheticGroupSource(cfg.collect.synthetic, seed=0, num_candidates=4,
                                                  vocab_size=2176))
    trainer = Trainer(cfg, run_dir=tmp_path, source=src)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert trainer.run() == SIGTERM_EXIT_CODE
    finally:
        trainer.close()
    assert signal.getsignal(signal.SIGTERM) == previous  # handler restored
    assert Checkpointer(tmp_path / "checkpoints", read_only=True).steps() == [2]
    meta = Checkpointer(tmp_path / "checkpoints", read_only=True).read_meta(2)
    assert meta["data"] == [{"next_step": 2}] and meta["step"] == 2 and meta["updates"] >= 2


def test_export_writes_hf_safetensors_of_the_checkpoint(reference, tmp_path):
    from actionopd_jax.model.weights import load_hf
    from actionopd_jax.train import export_cli
    from actionopd_jax.train.step import split_params

    out = tmp_path / "hf"
    assert export_cli.main(["--checkpoint", str(reference), "--step", "2", "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    _, model = load_hf(out)
    _, want = params_at(reference, 2)
    assert max_abs_diff(to_host(split_params(model)[1]), want) == 0
    assert export_cli.main(["--checkpoint", str(tmp_path / "nothing"), "--out", str(out)]) == 2
