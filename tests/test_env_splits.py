"""Training tasks vs evaluation tasks (envs/splits.py) on the real BFCL and tau2 package data:
BFCL training is refused without the opt-in (BFCL has no training split), an explicit disjoint
split is accepted, tau2's official train/test splits are disjoint (178 / 100), and `eval` is
told when it scores tasks a run trained on."""

import json

import pytest

from actionopd_jax.collect.source import train_task_stream
from actionopd_jax.envs.task_sets import training_task_sets
from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import load_config, replace_keys
from actionopd_jax.envs.splits import (TRAIN_TASKS_FILE, check_eval_overlap, eval_overlap_warning, overlap_summary,
                                       record_train_tasks, scored_task_ids)
from actionopd_jax.envs.tau2_tasks import DOMAINS, tau2_tasks
from actionopd_jax.eval.tasks import select_tasks


def _cfg(*overrides):
    return load_config(None, ["collect.kind=actionopd", "collect.task_starts_per_step=4", *overrides])


def test_bfcl_training_without_opt_in_is_refused_naming_the_overlap():
    # empty domains = every BFCL category; env.split=train means nothing for BFCL
    cfg = _cfg("env.name=bfcl", "env.split=train")
    with pytest.raises(ConfigError) as err:
        train_task_stream(cfg)
    msg = str(err.value)
    assert "800 of 800" in msg and "BFCL multi-turn" in msg and "multi_turn_base_0" in msg
    assert "env.allow_eval_overlap: true" in msg and "env.task_ids" in msg and "env.heldout_task_ids" in msg
    with pytest.raises(ConfigError, match="200 of 200 .* BFCL multi-turn"):
        train_task_stream(_cfg("env.name=bfcl", "env.domains=[miss_param]"))
    # the opt-in trains on them, and says so for --check
    ok = _cfg("env.name=bfcl", "env.allow_eval_overlap=true")
    assert len(train_task_stream(ok).tasks) == 800
    tasks = [t for _, ts in training_task_sets(ok.env, needed_by="test") for t in ts]
    assert "800 are scored by evaluation" in overlap_summary(ok.env, tasks)
    assert "ALLOWED by env.allow_eval_overlap: true" in overlap_summary(ok.env, tasks)
    # exactly what `eval --bench bfcl` scores
    assert scored_task_ids("bfcl") == {t.task_id for t in select_tasks("bfcl")}


def test_an_explicit_disjoint_bfcl_split_needs_no_opt_in():
    train = ["multi_turn_base_1", "multi_turn_base_5"]
    held = ["multi_turn_base_2"]
    cfg = _cfg("env.name=bfcl", "env.domains=[base]", f"env.task_ids={train}", f"env.heldout_task_ids={held}",
               "collect.task_starts_per_step=2")
    stream = train_task_stream(cfg)
    assert sorted(t.task_id for t in stream.tasks) == train
    assert {t.task_id for t in stream.next_step()} <= set(train)
    assert overlap_summary(cfg.env, stream.tasks) == ("2 training task(s), 1 held out (env.heldout_task_ids); "
                                                      "disjoint from the held-out tasks")
    # a held-out task among the training tasks is refused, naming it
    bad = replace_keys(cfg, **{"env.heldout_task_ids": ["multi_turn_base_5"]})
    with pytest.raises(ConfigError, match=r"1 of 2 .*env.heldout_task_ids.*multi_turn_base_5"):
        train_task_stream(bad)
    with pytest.raises(ConfigError, match="env.task_ids: 1 id.*multi_turn_base_9999"):
        train_task_stream(replace_keys(cfg, **{"env.task_ids": ["multi_turn_base_9999"]}))


def test_tau2_official_splits_are_disjoint_and_the_train_split_trains():
    train_total = test_total = 0
    for domain in DOMAINS:
        train = {t.task_id for t in tau2_tasks(domain, "train")}
        test = {t.task_id for t in tau2_tasks(domain, "test")}
        base = {t.task_id for t in tau2_tasks(domain, "base")}
        assert train and test and not (train & test), domain
        assert train | test == base, domain
        # `eval --bench tau2_<domain>` scores the test split
        assert scored_task_ids(f"tau2_{domain}") == test == {t.task_id for t in select_tasks(f"tau2_{domain}")}
        train_total, test_total = train_total + len(train), test_total + len(test)
    assert (train_total, test_total) == (178, 100)  # paper B.3: 30/20, 74/40, 74/40
    cfg = _cfg("env.name=tau2", "env.domains=[airline,retail,telecom]", "env.split=train",
               "collect.task_starts_per_step=3")
    assert len(train_task_stream(cfg).tasks) == 178
    with pytest.raises(ConfigError, match=r"100 of 278 .*tau2 airline.*env.split=train"):
        train_task_stream(replace_keys(cfg, **{"env.split": "base"}))
    with pytest.raises(ConfigError, match=r"20 of 20 .*tau2 airline"):
        train_task_stream(replace_keys(cfg, **{"env.split": "test", "env.domains": ["airline"]}))


def test_run_records_its_training_tasks_and_eval_warns_on_them(tmp_path):
    run = tmp_path / "run"
    trained = select_tasks("tau2_airline:train")[:3]
    record_train_tasks(run, trained)
    doc = json.loads((run / TRAIN_TASKS_FILE).read_text())
    assert {r["task_id"] for r in doc["tasks"]} == {t.task_id for t in trained}
    # eval of a checkpoint of that run (found from checkpoints/<step>/ up to the run dir)
    ckpt = run / "checkpoints" / "3"
    ckpt.mkdir(parents=True)
    scored = select_tasks("tau2_airline:train")[:5]
    warning = eval_overlap_warning(ckpt, scored)
    assert warning is not None and "3 of the 5 evaluated tasks were training tasks" in warning
    assert trained[0].task_id in warning
    assert eval_overlap_warning(ckpt, select_tasks("tau2_airline")) is None  # test split: disjoint
    assert eval_overlap_warning(tmp_path / "elsewhere", scored) is None      # no record, no warning
    # the same id in another environment is another task: not an evaluation task
    from actionopd_jax.types import Task

    assert check_eval_overlap(_cfg().env, [Task("multi_turn_base_0", "toy", "train", {})]).count == 0


def test_check_line_and_baselines_obey_the_same_rule():
    from actionopd_jax.baselines.wiring import tasks_from_env
    from actionopd_jax.collect.source import check_training_tasks

    tau2 = _cfg("env.name=tau2", "env.domains=[airline]", "env.split=train")
    assert check_training_tasks(tau2) == "tasks      30 training task(s); none of them is scored by `actionopd eval`"
    assert check_training_tasks(_cfg("collect.kind=synthetic")) is None
    bfcl = _cfg("env.name=bfcl", "env.domains=[base]")
    with pytest.raises(ConfigError, match="200 of 200"):
        check_training_tasks(bfcl)  # --check refuses with the run's own message
    with pytest.raises(ConfigError, match="200 of 200"):
        tasks_from_env(replace_keys(bfcl, **{"collect.kind": "kd", "train.loss": "kd"}))  # KD's teacher trajectories
    assert len(tasks_from_env(replace_keys(bfcl, **{"env.task_ids": ["multi_turn_base_7"],
                                              "env.heldout_task_ids": ["multi_turn_base_8"]}))) == 1
