"""The collector over the pool mixture's EnvScaler episodes (sandboxed class processes, our mini
data) with the privileged reference teacher (serve.reference_backend: it answers with our mini
data's reference solutions) behind our loopback server, rules-only matching.

1. A scripted student (fixed texts, so rewards are hand-computed) whose first candidate is the
   reference call at every state: r_lambda gives [1.5, 0, -1] (K=3 identical teacher samples,
   lambda=0.5: 1 + 0.5 * (3-1)/(3-1) = 1.5; a valid other call 0; an unparsable reply -1), the
   argmax commits the reference call, and each episode runs to the checks' success.
2. A tiny random Qwen3 through the real sampler: one collection step of the mixture stream."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actionopd_jax.config import EnvConfig
from actionopd_jax.envs.envscaler.layout import load_envscaler
from actionopd_jax.envs.mixture import mixture_stream_from
from actionopd_jax.envs.reference import ENVSCALER_DONE
from actionopd_jax.envs.registry import pool_env_factory
from actionopd_jax.matching.matcher import Matcher
from actionopd_jax.sampling import Generation
from actionopd_jax.serve.reference_backend import MODEL_NAME, ReferenceBackend
from actionopd_jax.types import Message, ToolCall
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (BAD, collect_once, collector_config, make_teacher, real_sample_fn, serve,
                                     student_text)

ES = Path(__file__).parent / "data" / "envscaler_mini"
HELD_OUT = ("mini_locker_2", "mini_clinic_2", "mini_clinic_3")  # the conversational one needs a simulator


@pytest.fixture(scope="module")
def env_cfg(tmp_path_factory):
    manifest = tmp_path_factory.mktemp("m") / "admitted.json"
    ids = sorted(t.task_id for t in load_envscaler(ES).tasks())
    manifest.write_text(json.dumps({"pools": {"envscaler": {"admitted": ids}}}))
    return EnvConfig(name="envscaler", envscaler_dir=str(ES), manifest=str(manifest), mixture=("envscaler:4",),
                     heldout_task_ids=HELD_OUT)


def _reference_calls():
    return {t.task_id: [ToolCall(a["name"], a["arguments"]) for a in t.payload["reference_actions"]]
            for t in load_envscaler(ES).tasks()}


def scripted_student(tokenizer, tasks, eos):
    """Candidates [reference action, a valid other call, unparsable] at every state."""
    refs = _reference_calls()
    texts = {t.task_id: t.payload["task"] for t in tasks}
    wrong = {"env_1": ToolCall("list_parcels", {"recipient": "Nobody"}),  # a valid call of each environment
             "env_2": ToolCall("find_slots", {"doctor": "Dr. Nobody"})}
    env_of = {t.task_id: t.payload["env_id"] for t in tasks}

    def run(prompts, keys):
        out = []
        for ids in prompts:
            text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
            task_id = next(i for i, t in texts.items() if t in text)
            decision = text.count("<|im_start|>assistant") - 1
            plan = refs[task_id]
            first = plan[decision] if decision < len(plan) else Message(ENVSCALER_DONE)
            gens = []
            other = wrong[env_of[task_id]] if isinstance(first, ToolCall) else Message("Something else.")
            for action in (first, other, BAD):
                toks = tokenizer.encode(student_text(action), add_special_tokens=False) + [eos]
                gens.append(Generation(np.asarray(toks, np.int32), np.full(len(toks), -0.5, np.float32), "stop"))
            out.append(gens)
        return out

    return run


def _collector(cfg, tokenizer, server, sample_fn, env_cfg):
    from actionopd_jax.collect import Collector

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return Collector(cfg, tokenizer=tokenizer, teacher=make_teacher(server, model=MODEL_NAME, provider="actionopd"),
                     matcher=Matcher(None), eos_ids=[eos], env_factory=pool_env_factory(env_cfg), sample_fn=sample_fn)


def test_scripted_student_on_the_mixture_gets_hand_computed_rewards_and_solves_the_tasks(tiny_tokenizer, env_cfg):
    stream = mixture_stream_from(env_cfg, per_step=4, seed=3)
    tasks = stream.next_step()
    assert {t.task_id for t in stream.tasks} == {"mini_locker_1", "mini_locker_3", "mini_clinic_1"}
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = collector_config(n=3, max_prompt_tokens=4096, max_new_tokens=64, env_timeout_s=30.0,
                           decision_limits=(("envscaler", 8),))
    with serve(ReferenceBackend(stream.tasks)) as server:
        collector = _collector(cfg, tiny_tokenizer, server, scripted_student(tiny_tokenizer, stream.tasks, eos), env_cfg)
        result = collect_once(collector, tasks, step=0, process_index=0, process_count=1)
    refs = _reference_calls()
    assert len(result.trajectories) == 4
    for rec in result.trajectories:
        assert rec.end_reason == "env_done" and rec.score["end_reason"] == "completed", rec
        assert rec.score["success"] and rec.score["reward"] == 1.0
        assert rec.decisions == len(refs[rec.task_id]) + 1  # the calls, then the closing message
    for g in result.groups:
        plan = refs[g.task_id]
        expected = plan[g.decision_index] if g.decision_index < len(plan) else Message(ENVSCALER_DONE)
        assert [s.action for s in g.teacher_samples] == [expected] * 3
        assert [c.reward for c in g.candidates] == [1.5, 0.0, -1.0]
        assert g.retained and g.committed_index == 0
    assert len(result.groups) == sum(len(refs[r.task_id]) + 1 for r in result.trajectories)


@pytest.mark.slow  # ~40 s: compiling the tiny model's sampler for a 2,048-token prompt bucket
@pytest.mark.timeout(600)
def test_tiny_model_collection_step_over_the_mixture(tiny_tokenizer, env_cfg):
    from actionopd_jax.sampling import Buckets, Sampler
    from tests._sampler_fixtures import random_model

    stream = mixture_stream_from(env_cfg, per_step=4, seed=3)
    tasks = stream.next_step()
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = collector_config(n=2, max_prompt_tokens=2048, max_new_tokens=16, env_timeout_s=30.0,
                           decision_limits=(("envscaler", 2),))
    model = random_model(0, vocab_size=len(tiny_tokenizer), max_position_embeddings=4096)
    sampler = Sampler(model, eos_ids=[eos], buckets=Buckets(prompt_len=(2048,), prompts=(4,), samples=(2,),
                                                            max_new=(16,), max_rows=8))
    with serve(ReferenceBackend(stream.tasks)) as server:
        collector = _collector(cfg, tiny_tokenizer, server, real_sample_fn(sampler, cfg), env_cfg)
        result = collect_once(collector, tasks, step=0, process_index=0, process_count=1)
    refs = _reference_calls()
    assert len(result.trajectories) == 4
    assert result.groups and all(0 < g.prompt_ids.size <= 2048 for g in result.groups)
    for g in result.groups:
        assert [s.action for s in g.teacher_samples] == [refs[g.task_id][g.decision_index]] * 3
        for c in g.candidates:  # r_lambda with K=3, lambda=0.5 on whatever the random student wrote
            assert c.reward in (-1.0, 0.0, 1.0, 1.25, 1.5)
    for rec in result.trajectories:
        assert rec.score["end_reason"] and "success" in rec.score and "checks" in rec.score
