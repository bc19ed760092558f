"""Damaged checkpoints as a new user meets them (issue 26): every step carries a checksum
manifest that a restore verifies, so three flipped bits in a params data file are found and
the step is refused or skipped with the reason; a skipped step is one clear line (no Orbax
tracebacks); an explicitly named damaged step is exit 2 with a message naming the steps that
are left."""

import functools
import json
import logging
import shutil
import subprocess
import sys

import pytest

from actionopd_jax.checkpoint import Checkpointer, CheckpointError
from actionopd_jax.checkpoint.checksums import MANIFEST
from actionopd_jax.config import Config
from actionopd_jax.config.load import replace_keys
from actionopd_jax.train.loop import Trainer
from actionopd_jax.train.sources import synthetic_source
from tests._subprocess_fixtures import cli_env


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A two-step run of the tiny model (synthetic groups) with its tokenizer recorded."""
    from actionopd_jax.chat import build_tiny_tokenizer

    d = tmp_path_factory.mktemp("integrity")
    tok = build_tiny_tokenizer(d / "tok")
    cfg = replace_keys(Config(), **{"experiment.enabled": False, "train.steps": 2, "train.lr": 1e-3,
                                    "model.tokenizer": str(tok), "run.progress": False, "run.tensorboard": False,
                                    "collect.synthetic.groups_per_step": 2})
    trainer = Trainer(cfg, run_dir=d / "run", source=functools.partial(synthetic_source, cfg))
    try:
        assert trainer.run() == 0
    finally:
        trainer.close()
    (d / "run" / "config.yaml").write_text(cfg.to_yaml())
    return d / "run"


def _copy(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    return run


def _largest_params_file(run, step):
    return max((p for p in (run / "checkpoints" / str(step) / "params").rglob("*") if p.is_file()
                and p.parent.name == "d"), key=lambda p: p.stat().st_size)


def _flip_three_bits(path):
    data = bytearray(path.read_bytes())
    for at, bit in ((len(data) // 3, 0), (len(data) // 2, 5), (2 * len(data) // 3, 7)):
        data[at] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_each_step_has_a_manifest_and_flipped_bits_are_refused_or_skipped(saved, tmp_path, caplog):
    run = _copy(saved, tmp_path)
    for step in (1, 2):
        files = json.loads((run / "checkpoints" / str(step) / MANIFEST).read_text())["files"]
        assert {k.split("/")[0] for k in files} >= {"params", "opt_state", "meta"}
    ckpt = Checkpointer(run / "checkpoints", read_only=True)
    try:
        assert ckpt.restore(None, 2, params_only=True).verified
        bad = _largest_params_file(run, 2)
        _flip_three_bits(bad)
        with caplog.at_level(logging.ERROR):
            r = ckpt.restore(None, params_only=True)
        assert r.step == 1 and r.verified
        assert f"{bad.relative_to(run / 'checkpoints' / '2')} does not match its checksum" in caplog.text
        assert "falling back to step 1" in caplog.text
        # step 1 as well: no "falling back" for a step with none before it (issue 34)
        _flip_three_bits(_largest_params_file(run, 1))
        caplog.clear()
        with caplog.at_level(logging.ERROR), pytest.raises(CheckpointError, match="no readable checkpoint"):
            ckpt.restore(None, params_only=True)
        assert "step 1 " in caplog.text and "no earlier step is left" in caplog.text
        assert caplog.text.count("falling back") == 1
        with pytest.raises(CheckpointError, match=r"step 2 .* does not match its checksum\); the other finished "
                                                  r"steps are \[1\] \(pass one of them"):
            ckpt.restore(None, 2, params_only=True)
    finally:
        ckpt.close()


def test_a_step_without_manifest_is_refused_unless_allowed(saved, tmp_path, caplog):
    """Issue 34: a step whose checksum manifest is missing cannot be checked: the latest falls
    back to a verified step, a named one is refused saying how to load it anyway, and with
    allow_unverified it loads, reported unverified."""
    from actionopd_jax.checkpoint import load_model

    run = _copy(saved, tmp_path)
    (run / "checkpoints" / "2" / MANIFEST).unlink()
    ckpt = Checkpointer(run / "checkpoints", read_only=True)
    try:
        with caplog.at_level(logging.ERROR):
            r = ckpt.restore(None, params_only=True)
        assert r.step == 1 and r.verified and "falling back to step 1" in caplog.text
        with pytest.raises(CheckpointError, match=r"step 2 .*no checksum manifest.*Pass --allow-unverified"):
            ckpt.restore(None, 2, params_only=True)
    finally:
        ckpt.close()
    allowed = Checkpointer(run / "checkpoints", read_only=True, allow_unverified=True)
    try:
        r = allowed.restore(None, params_only=True)
        assert r.step == 2 and not r.verified
    finally:
        allowed.close()
    _, _, info = load_model(run, allow_unverified=True)
    assert info["step"] == 2 and info["verified"] is False and info["fallback_from"] is None
    _, _, info = load_model(run)
    assert info["step"] == 1 and info["verified"] is True and info["fallback_from"] == 2


def _export(source, out):
    return subprocess.run([sys.executable, "-m", "actionopd_jax.commands", "export", "--checkpoint", str(source),
                           "--out", str(out)], env=cli_env(devices=1), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)


def test_a_damaged_step_without_manifest_falls_back_in_one_line_and_a_named_one_exits_2(saved, tmp_path):
    """Step 2 as an older trainer left it (no manifest) with every params data file cut short:
    Orbax's own read fails, and the fallback says so once, with no tracebacks."""
    run = _copy(saved, tmp_path)
    step2 = run / "checkpoints" / "2"
    (step2 / MANIFEST).unlink()
    for p in (step2 / "params").rglob("*"):
        if p.is_file() and p.parent.name == "d":
            p.write_bytes(p.read_bytes()[:100])
    fell_back = _export(run, tmp_path / "hf")
    assert fell_back.returncode == 0 and "exported step 1" in fell_back.stdout, fell_back.stdout[-3000:]
    assert "Traceback" not in fell_back.stdout and "Exception ignored" not in fell_back.stdout, fell_back.stdout
    assert fell_back.stdout.count("is unreadable") == 1 and "no checksum manifest" in fell_back.stdout

    named = _export(step2, tmp_path / "hf2")
    assert named.returncode == 2 and "Traceback" not in named.stdout, named.stdout[-3000:]
    assert "checkpoint step 2" in named.stdout and "the other finished steps are [1]" in named.stdout
    assert "[1, 2]" not in named.stdout


def test_scores_say_which_step_they_scored_after_a_fallback(saved, tmp_path, capsys):
    from actionopd_jax.eval import cli as eval_cli

    run = _copy(saved, tmp_path)
    _flip_three_bits(_largest_params_file(run, 2))
    out = tmp_path / "eval"
    args = ["--checkpoint", str(run), "--bench", "bfcl:base", "--limit", "1", "--max-new-tokens", "4",
            "--no-progress", "--out", str(out)]
    # the tiny model's context cannot hold a BFCL prompt: scored, written, and said (exit 1)
    assert eval_cli.main(args) == 1
    assert "episodes ended before the agent's first action" in capsys.readouterr().err
    want = {"checkpoint": str(run), "step": 1, "step_dir": str(run / "checkpoints" / "1"), "fallback_from": 2,
            "verified": True}
    assert json.loads((out / "results.json").read_text())["evaluated"] == want
    for name in ("episodes.jsonl", "trajectories.jsonl"):
        assert [json.loads(x)["evaluated"] for x in (out / name).read_text().splitlines()] == [want]
    assert f"Checkpoint: step 1 ({run / 'checkpoints' / '1'}), a fallback: step 2 was unreadable" in (
        out / "report.md").read_text()
    # resuming that folder with another step's weights is refused (the scores would mix)
    assert eval_cli.main(["--checkpoint", str(saved), *args[2:]]) == 2


def test_a_finished_save_gets_its_manifest_before_the_next_save(tmp_path):
    """The manifest of a finished async save is written by the loop's next step
    (Checkpointer.record_finished), not by the next save: a run killed in between resumes from
    the newest step, not the one before it."""
    import jax.numpy as jnp

    ckpt = Checkpointer(tmp_path / "ckpt", async_save=True)
    try:
        state = {"params": {"w": jnp.arange(4.0)}, "opt_state": {"m": jnp.zeros(4)}}
        assert ckpt.save(1, state, {"note": "first"})
        ckpt.manager.wait_until_finished()          # the save is final; no manifest written yet
        assert not (tmp_path / "ckpt" / "1" / MANIFEST).exists()
        ckpt.record_finished()
        assert (tmp_path / "ckpt" / "1" / MANIFEST).is_file()
        assert ckpt.restore(None, 1).verified       # a second process would trust it at once
    finally:
        ckpt.close()
