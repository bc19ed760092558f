"""`actionopd compare` (actionopd_jax/experiment/compare_*.py): the update budget held equal,
the table written, a failing method recorded without losing the others; tasks cut to their
first user turn (BFCL env payload max_turns), scored by the official checker.

The end-to-end test is the real harness in miniature: the embedded reference teacher over
HTTP, a short warm start, one optimizer update per method (ActionOPD's collector and trainer,
KD's trainer), the held-out evaluation, compare.md / compare.png."""

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from actionopd_jax.config import ConfigError
from actionopd_jax.experiment import compare_plan, compare_runner
from actionopd_jax.experiment.compare_plan import Method, UpdateBudget, load_compare
from actionopd_jax.types import Candidate, Message, StateGroup, Task, ToolCall
from tests._configs import CONFIGS

ROOT = Path(__file__).resolve().parents[1]


# --- tasks cut to their first user turn ----------------------------------------------------------

async def _play(task: Task, actions: list) -> tuple[int, dict]:
    from actionopd_jax.envs.registry import make_environment

    env = make_environment(task.env)
    obs = await env.reset(task)
    n = 0
    while not obs.done:
        obs, _ = await env.step(actions.pop(0))
        n += 1
    return n, env.score()


def test_first_user_turn_tasks_are_played_and_scored_on_that_turn_only():
    from actionopd_jax.envs.bfcl_data import bfcl_tasks

    whole = next(t for t in bfcl_tasks(("base",)) if t.task_id == "multi_turn_base_146")  # 4 user turns
    cut = compare_runner.cut_tasks([whole], 1)[0]
    assert cut.payload["max_turns"] == 1 and "max_turns" not in whole.payload
    # turn 1 of base_146 is get_watchlist(): the episode ends after it and the official checker passes it
    n, score = asyncio.run(_play(cut, [ToolCall("get_watchlist", {}), Message("Done")]))
    assert (n, score["official"], score["turns_completed"]) == (2, 1.0, 1)
    n, score = asyncio.run(_play(cut, [ToolCall("get_stock_info", {"symbol": "ZETA"}), Message("Done")]))
    assert score["official"] == 0.0 and "execution_response" in score["error_type"]
    # the whole task does not end after its first turn
    n, score = asyncio.run(_play(whole, [ToolCall("get_watchlist", {}), Message("Done"), Message("Done"),
                                         Message("Done"), Message("Done")]))
    assert n == 5 and score["turns_completed"] == 4
    bad = Task(whole.task_id, "bfcl", payload={"max_turns": "one"})
    with pytest.raises(ValueError, match="max_turns must be a whole number"):
        asyncio.run(_play(bad, []))


# --- settings --------------------------------------------------------------------------------------

def test_preset_loads_and_bad_settings_say_what_is_wrong():
    cfg, s = load_compare(CONFIGS / "compare_tiny.yaml", ["compare.seeds=0,1", "train.steps=2"])
    assert s.seeds == (0, 1) and s.updates == 8 and cfg.train.steps == 2
    assert (s.train_user_turns, s.eval_user_turns) == (0, (0, 1))
    from actionopd_jax.config.load import load_config

    main_job = load_config(CONFIGS / "tiny_cpu.yaml")
    # the main job's student, tasks and warm start; only the reference teacher disagrees with itself
    assert cfg.experiment == dataclasses.replace(main_job.experiment, reference=cfg.experiment.reference)
    assert (cfg.experiment.reference.alternative, cfg.experiment.reference.wrong) == (0.3, 0.1)
    assert main_job.experiment.reference.wrong == 0.0  # the main job's teacher stays deterministic
    with pytest.raises(ConfigError, match="unknown method"):
        load_compare(None, ["compare.methods=actionopd,nope"])
    with pytest.raises(ConfigError, match="unknown compare key"):
        load_compare(None, ["compare.budget=3"])
    with pytest.raises(ConfigError, match="compare.updates must be >= 1"):
        load_compare(None, ["compare.updates=0"])
    with pytest.raises(ConfigError, match="eval_user_turns must be distinct"):
        load_compare(None, ["compare.eval_user_turns=1,1"])
    assert "token log-probabilities" in compare_plan.not_runnable(compare_plan.METHODS["opd"], privileged_teacher=True)


# --- the budget lands exactly --------------------------------------------------------------------

def _group(i: int, n_rows: int, retained: bool = True) -> StateGroup:
    cands = [Candidate(token_ids=np.ones(3 if j < n_rows else 0, np.int32), logprobs=np.zeros(3, np.float32),
                       text="", action=Message("x"), reward=float(j)) for j in range(4)]
    return StateGroup("t", i, np.ones(3, np.int32), cands, [], committed_index=0, retained=retained)


class _Inner:
    def __init__(self, groups):
        self.groups = groups

    def collect(self, step, policy):
        return self.groups

    def metrics(self):
        return {"x": 1.0}


@pytest.mark.parametrize("remaining", [1, 2, 3, 9])
def test_update_budget_keeps_at_most_the_rows_of_the_remaining_updates(remaining):
    groups = [_group(i, 4) for i in range(7)] + [_group(7, 2), _group(8, 4, retained=False)]  # 30 learning rows
    budget = UpdateBudget(_Inner(groups), minibatch_rows=16, seed=0)
    budget.remaining = remaining
    out = budget.collect(0, None)
    rows = sum(compare_plan.rows_of(g) for g in out if g.retained)
    assert rows <= remaining * 16
    want = min(30, remaining * 16)
    assert compare_plan.expected_updates(rows, 16) == compare_plan.expected_updates(want, 16) == min(remaining, 2)
    assert budget.trimmed_groups == sum(g.drop_reason == "over_budget" for g in out)
    assert budget.metrics() == {"x": 1.0}  # the trainer still reads the source's metrics through it


# --- end to end: one update per method, a failing method, the table ---------------------------------

# Why the warm start is short and steep (suite time): at 20 epochs of lr 3e-3 every ActionOPD
# candidate stayed an invalid action for ~8 collection steps (each a rollout and a teacher round)
# before a group was active, which ran the test past its timeout under load; 8 epochs at lr 5e-2
# leave a student whose candidates are sometimes valid, so the first collection already updates.
# No TensorBoard writer: importing it costs ~10 s. Nothing asserted depends on the warm start's quality.
TINY = ["experiment.max_train_tasks=1", "experiment.max_heldout_tasks=1", "experiment.kd_epochs=0",
        "experiment.pretrain_epochs=8", "experiment.kd_lr=5e-2", "experiment.student.hidden_size=32",
        "experiment.student.intermediate_size=64", "run.tensorboard=false",
        "collect.max_response_tokens=16", "experiment.eval_max_new_tokens=16", "run.progress=false",
        "mesh.fsdp=1", "compare.updates=1", "compare.max_steps=12", "compare.seeds=0",
        "compare.train_user_turns=1", "compare.eval_user_turns=1",
        "compare.methods=actionopd,kd,broken,opd"]


def test_compare_one_update_budget_failing_method_and_table(tmp_path, monkeypatch):
    from actionopd_jax.experiment import compare_cli

    def broken(shared, method, seed, rdir):
        raise RuntimeError("deliberately broken method")

    monkeypatch.setitem(compare_plan.METHODS, "broken", Method("broken", "broken", "deliberately failing"))
    monkeypatch.setitem(compare_runner.RUNNERS, "broken", broken)
    run = tmp_path / "run"
    code = compare_cli.main(["--config", str(CONFIGS / "compare_tiny.yaml"), "--run-dir", str(run),
                             *TINY, f"experiment.cache_dir={tmp_path / 'cache'}"])
    assert code == 0
    summary = json.loads((run / "compare.json").read_text())
    res = {r["method"]: r for r in summary["results"]}

    # equal budgets: each run's counted updates (the optimizer's step counter, and the trainer's
    # per-step update counts on disk) equal the budget; teacher samples are reported
    for name in ("actionopd", "kd"):
        r = res[name]
        assert r["status"] == "ok" and r["updates"] == 1, r
        logged = [json.loads(x) for x in (run / "runs" / f"{name}-s0" / "metrics.jsonl").read_text().splitlines()]
        assert sum(m.get("updates", 0) for m in logged) == 1
        assert r["teacher_samples"] > 0 and 0.0 <= r["eval"]["first1"]["agreement_rate"] <= 1.0
    # KD asks the teacher afresh (4 episodes per task start), one request per teacher turn
    assert res["kd"]["teacher_requests"] == res["kd"]["teacher_samples"] > 0 and res["actionopd"]["teacher_requests"] > 0
    kd_episodes = [json.loads(x) for f in sorted((run / "runs" / "kd-s0" / "kd").iterdir())
                   for x in f.read_text().splitlines()]
    assert len(kd_episodes) == 4 * res["kd"]["steps"]

    # the failing method is recorded and the others kept
    assert res["broken"]["status"] == "failed" and "deliberately broken" in res["broken"]["error"]
    assert "deliberately broken" in (run / "runs" / "broken-s0" / "error.txt").read_text()
    assert res["opd"]["status"] == "not run" and res["opd"]["reason"]

    md = (run / "compare.md").read_text()
    assert "| ActionOPD | 1/1 seeds | 1 |" in md and "| KD (fresh teacher episodes) | 1/1 seeds | 1 |" in md
    assert "deliberately failing | 0/1 seeds (1 failed)" in md and "token-level OPD: needs" in md
    assert (run / "compare.png").read_bytes()[:4] == b"\x89PNG"
    for name in ("actionopd", "kd"):
        assert (run / "runs" / f"{name}-s0" / "eval" / "first1" / "summary.json").is_file()
    assert "first1: BFCL accuracy" in md
