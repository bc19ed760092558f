"""The main job end to end through the real command (`actionopd train` in a subprocess),
shortened: one training and one held-out task, one epoch of pretraining and of KD, one ActionOPD step, a smaller
student. Everything real: the embedded privileged reference teacher over HTTP, the collector,
the trainer, Orbax checkpoints, the eval harness, the report."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests._subprocess_fixtures import cli_env


SHORT = ["experiment.max_train_tasks=1", "experiment.max_heldout_tasks=1", "experiment.kd_epochs=1",
         "experiment.pretrain_epochs=1",
         "train.steps=1", "collect.max_decisions=3", "collect.max_response_tokens=32",
         "experiment.eval_max_new_tokens=32", "experiment.student.hidden_size=32",
         "experiment.student.intermediate_size=64", "experiment.student.head_dim=32", "run.progress=false"]


def _tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.timeout(300)   # the whole job: ~75 s on 2 idle cores, ~1.5x that on CI's (test_suite_budget.py)
def test_short_main_job_through_the_cli(tmp_path):
    cmd = [sys.executable, "-m", "actionopd_jax.commands", "train", *SHORT, f"experiment.cache_dir={tmp_path / 'cache'}"]
    r = subprocess.run(cmd, cwd=tmp_path, env=cli_env(devices=1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    (run,) = list((tmp_path / "runs").glob("*-tiny_cpu"))

    # the summary table, and a progress header per phase
    assert "main job summary" in r.stdout and "ActionOPD mean reward" in r.stdout
    assert "privileged reference teacher" in r.stdout
    for i in range(1, 7):
        assert f"[main job {i}/6]" in r.stderr

    # configs: the resolved job config and what each phase ran with
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["experiment"]["enabled"] is True and resolved["experiment"]["max_train_tasks"] == 1
    phase = yaml.safe_load((run / "actionopd_config.yaml").read_text())
    assert phase["collect"]["kind"] == "actionopd" and phase["matcher"]["kind"] == "rules"
    assert phase["teacher"]["base_url"].startswith("http://127.0.0.1:") and phase["train"]["lr"] == resolved["experiment"]["opd_lr"]
    for stage in ("pretrain", "kd"):
        assert yaml.safe_load((run / "warm_start" / stage / "config.yaml").read_text())["train"]["loss"] == "kd"
        assert (run / "warm_start" / stage / "metrics.jsonl").read_text().strip()
    assert "PRIVILEGED REFERENCE TEACHER" in (run / "train.log").read_text()

    # trainer outputs: metrics with the job's per-step numbers, TensorBoard, the checkpoint
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1] and "collect/job/reward_mean" in steps[0]
    # an update (and its loss) happens exactly when some group kept a learning signal
    assert ("loss" in steps[0]) == (steps[0]["collect/job/groups_retained"] > 0)
    assert list((run / "tb").iterdir()) and (run / "checkpoints" / "1").is_dir()

    # the students: KD moved the random init, ActionOPD's checkpoint exported with its tokenizer
    init, kd = _tensors(run / "student_init"), _tensors(run / "warm_start" / "kd" / "student_hf")
    final = _tensors(run / "student_final")
    assert set(init) == set(kd) == set(final)
    assert any(not np.array_equal(init[k], kd[k]) for k in init)
    assert (run / "student_final" / "tokenizer.json").is_file()

    # evaluations and the report
    summary = json.loads((run / "report" / "summary.json").read_text())
    history = summary["actionopd"]["history"]
    # the ActionOPD phase trains on the job's own explicit, disjoint split, recorded in the run dir
    assert phase["env"]["task_ids"] == summary["tasks"]["train"] and not phase["env"]["allow_eval_overlap"]
    assert phase["env"]["heldout_task_ids"] == summary["tasks"]["heldout"]
    recorded = json.loads((run / "train_tasks.json").read_text())["tasks"]
    assert sorted(r["task_id"] for r in recorded) == sorted(summary["tasks"]["train"])
    assert [h["step"] for h in history] == [0.0, 1.0]  # warm-start-only start, then the final policy
    for h in history:
        assert h["candidates"] > 0 and -1.0 <= h["reward_mean"] <= 1.5 and 0 <= h["invalid_rate"] <= 1
    for side in ("before", "after"):
        ev = json.loads((run / "eval" / side / "summary.json").read_text())
        assert ev["episodes"] == 1 and ev["decisions"] > 0 and 0 <= ev["agreement_rate"] <= 1
    md = (run / "report.md").read_text()
    assert "privileged" in md and "warm start only" in md and "agrees with reference action" in md
    # issue 35: the spend section, the embedded teacher priced at zero and its tokens counted
    assert "## What the remote models cost (ActionOPD phase)" in md
    teacher_row = next(line for line in md.splitlines() if line.startswith("| teacher |"))
    requests, _, prompt, completion, money = [c.strip() for c in teacher_row.split("|")[2:7]]
    assert int(requests.replace(",", "")) == steps[0]["collect/teacher/requests_total"] > 0
    assert int(prompt.replace(",", "")) > 0 and money == "$0.0000"
    assert summary["spend"]["teacher/spend_usd_total"] == 0.0 and "remote models" in r.stdout
    for png in ("actionopd_curves.png", "heldout_before_after.png", "warm_start_loss.png", "spend.png"):
        assert (run / "report" / png).read_bytes()[:4] == b"\x89PNG"
    assert set(summary["timings"]) >= {"setup", "warm_start", "eval_before", "actionopd", "eval_after", "total"}
