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


def test_the_asynchronous_method_takes_eta_from_compare_max_staleness_and_is_checked_before_it_runs():
    cfg, s = load_compare(CONFIGS / "compare_tiny.yaml", ["compare.methods=actionopd,actionopd_async",
                                                          "collect.sampler=static"])
    assert s.max_staleness == 1 and cfg.collect.max_staleness == 0   # the run config stays synchronous
    m = compare_plan.resolve_method("actionopd_async", s)
    assert (m.kind, m.overrides, m.label) == ("actionopd", {"collect.max_staleness": 1}, "ActionOPD, eta=1")
    _, s2 = load_compare(CONFIGS / "compare_tiny.yaml", ["compare.methods=actionopd_async", "compare.max_staleness=2"])
    assert compare_plan.resolve_method("actionopd_async", s2).overrides == {"collect.max_staleness": 2}
    assert compare_plan.resolve_method("actionopd_async", s2).label == "ActionOPD, eta=2"
    assert compare_plan.resolve_method("actionopd", s2) is compare_plan.METHODS["actionopd"]   # eta 0, untouched
    with pytest.raises(ConfigError, match="compare.max_staleness is actionopd_async's eta and must be >= 1"):
        load_compare(None, ["compare.max_staleness=0"])
    # a run config the asynchronous method cannot run on is refused at load (and --check), before the warm start
    with pytest.raises(ConfigError, match="actionopd_async .*needs train.old_logprobs=recompute"):
        load_compare(CONFIGS / "compare_tiny.yaml", ["compare.methods=actionopd,actionopd_async",
                                                     "train.old_logprobs=sampler"])
    load_compare(CONFIGS / "compare_tiny.yaml", ["compare.methods=actionopd", "train.old_logprobs=sampler"])  # eta 0: fine


def test_task_starts_per_step_reaches_every_runs_config_and_zero_keeps_every_training_task(tmp_path, monkeypatch):
    """compare.task_starts_per_step makes a run take several collection steps (what eta=1 needs to
    overlap anything); 0 keeps the main job's phase: every training task started once a step."""
    cfg, s = load_compare(CONFIGS / "compare_tiny.yaml", ["compare.task_starts_per_step=2"])
    assert s.task_starts_per_step == 2
    train = [Task(f"t{i}", "bfcl") for i in range(5)]
    shared = compare_runner.Shared(cfg=cfg, teacher_cfg=cfg, teacher_over={}, settings=s, train=train,
                                   heldout={"whole": [Task("h0", "bfcl", split="heldout")]}, tokenizer=None,
                                   tokenizer_dir=tmp_path, start_dir=tmp_path, trajectories=tmp_path, privileged=False)
    for name in ("actionopd", "actionopd_async", "kd"):
        method = compare_plan.resolve_method(name, s)
        assert compare_runner.method_config(shared, method, 0, tmp_path).collect.task_starts_per_step == 2
    # and the phase's task stream starts that many a step (the collector itself is not built here)
    from actionopd_jax.baselines import wiring
    from actionopd_jax.experiment import phases
    from actionopd_jax.train import setup

    streams = []
    monkeypatch.setattr(setup, "model_config", lambda cfg: None)   # no student on disk here
    monkeypatch.setattr(wiring, "collector_source_class",
                        lambda cfg: lambda cfg, ctx, stream, buckets: streams.append(stream))
    pcfg = compare_runner.method_config(shared, compare_plan.METHODS["actionopd"], 0, tmp_path)
    phases.actionopd_source(pcfg, tasks=train, run_dir=tmp_path, name="bfcl:compare-train")
    assert streams[0].step_size == 2 and len(streams[0].next_step()) == 2
    every = dataclasses.replace(shared, settings=dataclasses.replace(s, task_starts_per_step=0))
    assert compare_runner.method_config(every, compare_plan.METHODS["actionopd"], 0, tmp_path).collect.task_starts_per_step == 5
    with pytest.raises(ConfigError, match="task_starts_per_step >= 0"):
        load_compare(None, ["compare.task_starts_per_step=-1"])


class _Stepper:
    """A trainer whose steps update nothing (as when no group is active) or fail at `fail_at`."""

    def __init__(self, fail_at=-1):
        import jax.numpy as jnp

        self.step, self.fail_at, self.saved = 0, fail_at, 0
        self.state = {"step": jnp.zeros((), jnp.int32)}
        self.writer = type("W", (), {"write": lambda *a: None})()
        self.ckpt = type("C", (), {"wait": lambda *a: None})()

    def train_step(self):
        if self.step == self.fail_at:
            raise RuntimeError("a failed step")
        self.step += 1
        return {"updates": 0, "collect/async/staleness_0": 2.0, "collect/async/stale_dropped": 1.0,
                "collect/async/max_staleness": 1.0}

    def save(self):
        self.saved += 1


class _Background:
    def __init__(self):
        self.stopped = 0

    def stop_background(self):
        self.stopped += 1


def test_the_step_cap_and_a_failed_step_stop_the_asynchronous_loop():
    s = compare_plan.CompareSettings(methods=("actionopd_async",), updates=3, max_steps=2)
    trainer, source = _Stepper(), _Background()
    spent = compare_runner.train_to_budget(trainer, source, s, lambda: "")
    # the step cap ends the run short of its budget; the draws ahead are stopped, then it saves
    assert (trainer.step, spent.updates, len(spent.step_s), trainer.saved, source.stopped) == (2, 0, 2, 1, 1)
    assert spent.async_sums == {"staleness_0": 4.0, "stale_dropped": 2.0}   # summed; eta itself is not
    trainer, source = _Stepper(fail_at=1), _Background()
    with pytest.raises(RuntimeError, match="a failed step"):
        compare_runner.train_to_budget(trainer, source, s, lambda: "")
    assert source.stopped == 1 and trainer.saved == 0
    # the job's source passes the stop on to the asynchronous source it wraps
    from actionopd_jax.experiment.phases import JobSource

    inner = _Background()
    UpdateBudget(JobSource(inner), minibatch_rows=16, seed=0).stop_background()
    assert inner.stopped == 1
    JobSource(_Inner([])).stop_background()   # a synchronous source has none: nothing to stop


def test_the_report_gives_each_methods_wall_clock_and_its_ratio_to_actionopd():
    from actionopd_jax.experiment import compare_report

    def run(method, seed, train_s, agree, **extra):
        return {"method": method, "label": method, "seed": seed, "status": "ok", "updates": 8, "steps": 9,
                "teacher_samples": 100, "train_s": train_s, "eval_s": 5.0, "step_s": [4.0, 1.5, 2.5],
                "eval": {"whole": {"agreement_rate": agree, "bfcl_accuracy": 0.0, "same_tool_rate": 0.5,
                                   "valid_rate": 0.9}}, **extra}

    summary = {"info": {"evals": ["whole"]}, "settings": {"updates": 8, "seeds": [0, 1, 2]}, "wall_s": 60.0,
               "warm_start_eval": {"whole": {"agreement_rate": 0.4, "bfcl_accuracy": 0.0, "same_tool_rate": 0.5,
                                             "valid_rate": 0.8}},
               "results": [run("actionopd", 0, 100.0, 0.50), run("actionopd", 1, 110.0, 0.55),
                           run("actionopd", 2, 120.0, 0.60),
                           run("actionopd_async", 0, 50.0, 0.52), run("actionopd_async", 1, 60.0, 0.54),
                           run("actionopd_async", 2, 70.0, 0.56,
                               **{"async": {"staleness_0": 3.0, "staleness_1": 5.0, "stale_dropped": 0.0,
                                            "wait_s": 1.25}}),
                           {"method": "kd", "label": "kd", "status": "not run", "reason": "x"}]}
    head = compare_report.header(summary)
    rows = {r[0]: dict(zip(head, r)) for r in compare_report.table_rows(summary)}
    # by hand: ActionOPD 110 ± 10 s, eta=1 60 ± 10 s, 60 / 110 = 0.545; agreement 55.0 ± 5.0% and 54.0 ± 2.0%
    assert rows["actionopd"]["train s"] == "110.0 ± 10.0" and rows["actionopd"]["train s vs ActionOPD"] == "1.00x"
    assert rows["actionopd_async"]["train s"] == "60.0 ± 10.0"
    assert rows["actionopd_async"]["train s vs ActionOPD"] == "0.55x"
    assert rows["actionopd"]["whole: agrees with reference"] == "55.0 ± 5.0%"
    assert rows["actionopd_async"]["whole: agrees with reference"] == "54.0 ± 2.0%"
    assert rows["kd"]["train s"] == rows["kd"]["train s vs ActionOPD"] == "-"
    # without ActionOPD in the comparison there is no ratio
    alone = {**summary, "results": [r for r in summary["results"] if r["method"] != "actionopd"]}
    assert {r[0]: r[5] for r in compare_report.table_rows(alone)}["actionopd_async"] == "-"
    # per run: the steps after the first (compiling) one, and an asynchronous run's staleness
    per_run = compare_report.per_run_table(summary)
    assert "| actionopd_async | 2 | ok |" in per_run and "| 70.0 | 4.0 | 5.0 | 3/5; dropped 0; waited 1.2 s |" in per_run


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
        "compare.methods=actionopd,actionopd_async,kd,broken,opd",
        "collect.sampler=static"]   # both ActionOPD arms alike: eta >= 1 refuses the engine (auto on CPU) today


def test_compare_one_update_budget_failing_method_and_table(tmp_path, monkeypatch):
    from actionopd_jax.experiment import compare_cli

    def broken(shared, method, seed, rdir):
        raise RuntimeError("deliberately broken method")

    monkeypatch.setitem(compare_plan.METHODS, "broken", Method("broken", "broken", "deliberately failing"))
    monkeypatch.setitem(compare_runner.RUNNERS, "broken", broken)
    import threading

    from actionopd_jax.train.loop import Trainer

    looping_at_save = []   # per save: was an asynchronous collection loop still running?
    save = Trainer.save

    def spy(self, *a, **k):
        looping_at_save.append(any(t.name == "async-collect" and t.is_alive() for t in threading.enumerate()))
        return save(self, *a, **k)

    monkeypatch.setattr(Trainer, "save", spy)
    run = tmp_path / "run"
    code = compare_cli.main(["--config", str(CONFIGS / "compare_tiny.yaml"), "--run-dir", str(run),
                             *TINY, f"experiment.cache_dir={tmp_path / 'cache'}"])
    assert code == 0
    summary = json.loads((run / "compare.json").read_text())
    res = {r["method"]: r for r in summary["results"]}

    # equal budgets: each run's counted updates (the optimizer's step counter, and the trainer's
    # per-step update counts on disk) equal the budget; teacher samples are reported
    for name in ("actionopd", "actionopd_async", "kd"):
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
    # the asynchronous arm ran at eta=1 and its loop was stopped at the budget, before the save
    asy = res["actionopd_async"]
    assert asy["max_staleness"] == 1 and res["actionopd"]["max_staleness"] == 0 and asy["label"] == "ActionOPD, eta=1"
    assert asy["async"]["stale_dropped"] == 0 and sum(v for k, v in asy["async"].items() if k.startswith("staleness_"))
    assert looping_at_save and not any(looping_at_save)   # every save: the runs', the warm start's

    # the failing method is recorded and the others kept
    assert res["broken"]["status"] == "failed" and "deliberately broken" in res["broken"]["error"]
    assert "deliberately broken" in (run / "runs" / "broken-s0" / "error.txt").read_text()
    assert res["opd"]["status"] == "not run" and res["opd"]["reason"]

    md = (run / "compare.md").read_text()
    assert "| ActionOPD | 1/1 seeds | 1 |" in md and "| ActionOPD, eta=1 | 1/1 seeds | 1 |" in md and "| KD (fresh teacher episodes) | 1/1 seeds | 1 |" in md
    assert "deliberately failing | 0/1 seeds (1 failed)" in md and "token-level OPD: needs" in md
    assert (run / "compare.png").read_bytes()[:4] == b"\x89PNG"
    for name in ("actionopd", "kd"):
        assert (run / "runs" / f"{name}-s0" / "eval" / "first1" / "summary.json").is_file()
    assert "first1: BFCL accuracy" in md
