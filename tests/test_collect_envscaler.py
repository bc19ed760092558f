"""The collector over the AWM + EnvScaler mixture (one collection step draws from both pools:
AWM's contained MCP servers, EnvScaler's sandboxed class processes, our mini data) with the
privileged reference teacher (serve.reference_backend: it answers with our mini data's
reference solutions) behind our loopback server, rules-only matching.

1. A scripted student (fixed texts, so rewards are hand-computed) whose first candidate is the
   reference action at every state: r_lambda gives [1.5, 0, -1] (K=3 identical teacher samples,
   lambda=0.5: 1 + 0.5 * (3-1)/(3-1) = 1.5; a valid other action 0; an unparsable reply -1), the
   argmax commits the reference action, and every episode ends in its verifier's / checks' success.
2. A tiny random Qwen3 through the real sampler: one collection step of the mixture stream."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from actionopd_jax.config import EnvConfig
from actionopd_jax.envs.envscaler.layout import load_envscaler
from actionopd_jax.envs.mixture import mixture_stream_from
from actionopd_jax.envs.reference import ENVSCALER_DONE
from actionopd_jax.envs.registry import close_env_factory, pool_env_factory
from actionopd_jax.matching.matcher import Matcher
from actionopd_jax.serve.reference_backend import MODEL_NAME, ReferenceBackend
from actionopd_jax.types import Message, ToolCall
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (collect_once, collector_config, launchers_of_this_process, make_teacher,
                                    plan_student, real_sample_fn, serve)

DATA = Path(__file__).parent / "data"
ES, AWM = DATA / "envscaler_mini", DATA / "awm_mini"
HELD_OUT = ("mini_locker_2", "mini_clinic_2", "mini_clinic_3")  # the conversational one needs a simulator
AWM_SQL = ("recipe_box_2/3", "gym_classes_3/3")  # verified in SQL + judge mode: kept out (no judge here)


@pytest.fixture(scope="module")
def env_cfg(tmp_path_factory):
    from actionopd_jax.envs.awm.layout import load_awm

    manifest = tmp_path_factory.mktemp("m") / "admitted.json"
    es_ids = sorted(t.task_id for t in load_envscaler(ES).tasks())
    awm_ids = sorted(t.task_id for t in load_awm(AWM).tasks())
    manifest.write_text(json.dumps({"pools": {"envscaler": {"admitted": es_ids},
                                              "awm": {"dir": str(AWM), "admitted": awm_ids, "heldout": list(AWM_SQL)}}}))
    return EnvConfig(name="awm", awm_dir=str(AWM), envscaler_dir=str(ES), manifest=str(manifest),
                     mixture=("awm:2", "envscaler:2"), heldout_task_ids=HELD_OUT, mcp_pool_size=2)


def _plans(tasks):
    """Task id -> the reference actions in order, closing message included."""
    out = {}
    for t in tasks:
        if t.env == "envscaler":
            out[t.task_id] = [ToolCall(a["name"], a["arguments"]) for a in t.payload["reference_actions"]] + \
                [Message(ENVSCALER_DONE)]
        else:
            steps = t.payload["reference_solution"]
            out[t.task_id] = [ToolCall(s["tool"], s.get("arguments") or {}) for s in steps if "tool" in s] + \
                [Message(next((s["message"] for s in steps if "message" in s), "Done."))]
    return out


def scripted_student(tokenizer, tasks, eos, first=lambda ref: [ref]):
    """Candidates [*first(reference action), a valid other action, unparsable] at every state
    (`first` rewrites the reference: the execution tests and benchmark pass their variants)."""
    texts = {t.task_id: t.payload["task"] for t in tasks}
    return plan_student(tokenizer, _plans(tasks), lambda text: next(i for i, t in texts.items() if t in text), eos,
                        first=first)


@contextlib.contextmanager
def _collector(cfg, tokenizer, server, sample_fn, env_cfg):
    """A collector over the mixture's pools, which end on leaving (their AWM servers with them;
    collect_once closes the collector itself)."""
    from actionopd_jax.collect import Collector

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    envs = pool_env_factory(env_cfg)
    try:
        yield Collector(cfg, tokenizer=tokenizer, teacher=make_teacher(server, model=MODEL_NAME, provider="actionopd"),
                        matcher=Matcher(None), eos_ids=[eos], env_factory=envs, sample_fn=sample_fn)
    finally:
        close_env_factory(envs)


def test_one_step_draws_both_pools_and_a_scripted_student_gets_hand_computed_rewards(tiny_tokenizer, env_cfg):
    stream = mixture_stream_from(env_cfg, per_step=4, seed=3)
    tasks = stream.next_step()
    assert [t.env for t in tasks] == ["awm", "awm", "envscaler", "envscaler"]
    assert {t.task_id for t in stream.tasks if t.env == "envscaler"} == {"mini_locker_1", "mini_locker_3", "mini_clinic_1"}
    assert not {t.task_id for t in stream.tasks} & set(AWM_SQL)
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = collector_config(n=3, max_prompt_tokens=4096, max_new_tokens=64, env_timeout_s=60.0,
                           teacher_timeout_s=60.0, decision_limits=(("envscaler", 8), ("awm", 8)))
    with serve(ReferenceBackend(stream.tasks)) as server:
        student = scripted_student(tiny_tokenizer, stream.tasks, eos)
        with _collector(cfg, tiny_tokenizer, server, student, env_cfg) as collector:
            result = collect_once(collector, tasks, step=0, process_index=0, process_count=1)
    plans = _plans(tasks)
    assert len(result.trajectories) == 4
    for rec in result.trajectories:
        assert rec.end_reason == "env_done", rec
        assert rec.score["success"] and rec.score["reward"] == 1.0, rec.score
        assert rec.decisions == len(plans[rec.task_id])  # the calls, then the closing message
    for g in result.groups:
        assert [s.action for s in g.teacher_samples] == [plans[g.task_id][g.decision_index]] * 3
        assert [c.reward for c in g.candidates] == [1.5, 0.0, -1.0]
        assert g.retained and g.committed_index == 0
    assert len(result.groups) == sum(len(plans[r.task_id]) for r in result.trajectories)


def test_tiny_model_collection_step_over_the_mixture(tiny_tokenizer, env_cfg):
    from actionopd_jax.sampling import Buckets, Sampler
    from tests._sampler_fixtures import random_model

    stream = mixture_stream_from(env_cfg, per_step=4, seed=3)
    tasks = stream.next_step()
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = collector_config(n=2, max_prompt_tokens=1024, max_new_tokens=16, env_timeout_s=30.0,
                           decision_limits=(("envscaler", 2), ("awm", 2)))
    model = random_model(0, vocab_size=len(tiny_tokenizer), max_position_embeddings=4096)
    sampler = Sampler(model, eos_ids=[eos], buckets=Buckets(prompt_len=(1024,), prompts=(4,), samples=(2,),
                                                            max_new=(16,), max_rows=8))
    with serve(ReferenceBackend(stream.tasks)) as server:
        with _collector(cfg, tiny_tokenizer, server, real_sample_fn(sampler, cfg), env_cfg) as collector:
            result = collect_once(collector, tasks, step=0, process_index=0, process_count=1)
    plans = _plans(tasks)
    assert len(result.trajectories) == 4 and {r.env for r in result.trajectories} == {"awm", "envscaler"}
    assert result.groups and all(0 < g.prompt_ids.size <= 1024 for g in result.groups)
    # both pools' openings fit the 1,024-token bucket and gave groups (it was 2,048: twice the compile)
    env_of = {t.task_id: t.env for t in tasks}
    assert {env_of[g.task_id] for g in result.groups} == {"awm", "envscaler"}
    for g in result.groups:
        assert [s.action for s in g.teacher_samples] == [plans[g.task_id][g.decision_index]] * 3
        for c in g.candidates:  # r_lambda with K=3, lambda=0.5 on whatever the random student wrote
            assert c.reward in (-1.0, 0.0, 1.0, 1.25, 1.5)
    for rec in result.trajectories:
        assert rec.score["end_reason"] and "success" in rec.score  # the verifier's / the checks' verdict
        assert rec.env != "envscaler" or len(rec.score["checks"]) >= 1


def test_eval_on_held_out_envscaler_tasks_prints_success(tmp_path, capsys):
    """`actionopd eval --bench envscaler:DIR:ids` on the held-out mini tasks, the conversational one
    played by a scripted user behind our real HTTP server (it restates its goal, then stops when
    told the task is done): the privileged reference policy solves all three."""
    from actionopd_jax.commands.main import main
    from actionopd_jax.envs.envscaler.user import GREETING
    from actionopd_jax.envs.user_sim import STOP
    from actionopd_jax.serve.scripted import ScriptedBackend, message_choice

    def user(req):
        last = req.messages[-1]["content"]
        if last == GREETING:
            return message_choice(req.messages[0]["content"].split("# Your goal\n", 1)[1])
        return message_choice(STOP if last == ENVSCALER_DONE else "Please go on.")

    with serve(ScriptedBackend("user", user)) as server:
        code = main(["eval", "--reference", "--bench", f"envscaler:{ES}:{','.join(HELD_OUT)}", "--out", str(tmp_path),
                     "--user-sim-url", server.base_url, "--user-sim-model", "user", "--user-sim-temperature", "1.0",
                     "--user-sim-provider", "actionopd", "--trials", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| benchmark | group | episodes | success | pass^1 | reward |" in out
    assert "| envscaler | eval | 3 | 100.0 | 100.0 | 100.0 |" in out
    records = [json.loads(x) for x in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert sorted(r["task_id"] for r in records) == sorted(HELD_OUT)
    assert all(r["score"]["success"] for r in records)


def test_tiny_train_on_the_mixture_then_eval_on_held_out_tasks(tmp_path, tiny_tokenizer_dir, env_cfg, capsys):
    """The documented tiny run (BUILD_NOTES): teacher.kind=reference starts the embedded privileged
    reference teacher; one step over AWM + EnvScaler, then the held-out EnvScaler tasks scored."""
    from actionopd_jax.commands.main import main

    run_dir = tmp_path / "run"
    before = set(launchers_of_this_process())   # another test's in this worker are not this run's
    assert main(["train", "experiment.enabled=false", "model.preset=tiny", f"model.tokenizer={tiny_tokenizer_dir}",
                 "collect.kind=actionopd", "teacher.kind=reference", "matcher.kind=rules", "env.name=awm",
                 f"env.awm_dir={AWM}", f"env.envscaler_dir={ES}", f"env.manifest={env_cfg.manifest}",
                 "env.mixture=[awm:3,envscaler:1]", f"env.heldout_task_ids=[{','.join(HELD_OUT)}]", "train.steps=1",
                 "collect.task_starts_per_step=4", "collect.num_candidates=2", "collect.max_response_tokens=16",
                 "collect.max_prompt_tokens=2048", "train.max_seq_len=2048", "run.progress=false",
                 "--run-dir", str(run_dir)]) == 0
    assert set(launchers_of_this_process()) <= before   # the run's AWM servers ended with it (Trainer.close)
    trained = json.loads((run_dir / "train_tasks.json").read_text())["tasks"]
    assert {t["env"] for t in trained} == {"awm", "envscaler"} and not {t["task_id"] for t in trained} & set(HELD_OUT)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run_dir), "--bench", f"envscaler:{ES}:mini_locker_2,mini_clinic_2",
                 "--max-new-tokens", "16", "--trials", "1", "--out", str(tmp_path / "eval"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| benchmark | group | episodes | success |" in out and "| envscaler | eval | 2 |" in out
