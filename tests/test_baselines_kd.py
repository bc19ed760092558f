"""Offline KD baseline (paper B.4): successful teacher trajectories -> one example per
assistant turn -> cross-entropy on target tokens through the trainer's own train step."""

import asyncio
import json

import numpy as np
import pytest
from flax import nnx

from actionopd_jax.baselines.kd import (KDExample, KDGroupSource, kd_examples, load_trajectories, run_kd,
                                        teacher_trajectories)
from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer, render_ids, render_text
from actionopd_jax.envs.registry import make_environment
from actionopd_jax.eval.agents import EndpointAgent
from actionopd_jax.eval.tasks import select_tasks
from actionopd_jax.model import PRESETS, Qwen3
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.reference_backend import ReferenceBackend
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from tests._baselines_fixtures import (TOY_ANSWER, direct_target_logprobs, tiny_run_config, toy_tasks,
                                       toy_teacher_backend, toy_trajectories)

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_bfcl_reference_teacher_trajectories_become_one_example_per_assistant_turn(tok, tmp_path):
    """Privileged reference teacher over HTTP on two BFCL tasks (both succeed) and a quitter
    (fails, dropped). Every assistant turn is one example whose prompt is exactly the
    rendered history and whose target is exactly the rendered turn through <|im_end|>."""
    tasks = [t for t in select_tasks("bfcl:base", limit=4) if t.task_id in ("multi_turn_base_1", "multi_turn_base_3")]
    quit_backend = ScriptedBackend("quitter", lambda r: message_choice("I can't."))
    with OpenAIServer([ReferenceBackend(tasks), quit_backend]) as srv:
        ref = EndpointAgent(srv.base_url, "reference-teacher-privileged")
        records = asyncio.run(teacher_trajectories(ref, tasks, lambda t: make_environment(t.env), trials=1,
                                                   out_jsonl=tmp_path / "ref.jsonl"))
        # (an AsyncOpenAI client belongs to one event loop: one agent per asyncio.run)
        dropped = asyncio.run(teacher_trajectories(EndpointAgent(srv.base_url, "quitter"), tasks,
                                                   lambda t: make_environment(t.env)))
        everything = asyncio.run(teacher_trajectories(EndpointAgent(srv.base_url, "quitter"), tasks,
                                                      lambda t: make_environment(t.env), keep_successful=False))
    assert [r["task_id"] for r in records] == ["multi_turn_base_1", "multi_turn_base_3"]
    assert all(r["score"]["reward"] == 1.0 for r in records)
    assert dropped == [] and len(everything) == 2 and all(r["score"]["reward"] == 0.0 for r in everything)
    # the JSONL keeps the conversations: reloading gives the same records
    reloaded = {r["task_id"]: r["messages"] for r in load_trajectories(tmp_path / "ref.jsonl")}
    assert reloaded == {r["task_id"]: r["messages"] for r in records}

    examples = kd_examples(records, tok, max_prompt_tokens=8192)
    n_turns = sum(1 for r in records for m in r["messages"] if m["role"] == "assistant")
    assert len(examples) == n_turns == sum(len(r["turns"]) for r in records)
    end_id = tok.convert_tokens_to_ids(END)
    by_task = {r["task_id"]: r for r in records}
    for ex in examples:
        rec = by_task[ex.task_id]
        turn = next(t for t in rec["turns"] if t["index"] == ex.message_index)
        tools = rec["tool_sets"][turn["tools"]]
        history = rec["messages"][: ex.message_index]
        assert np.array_equal(ex.prompt_ids, render_ids(tok, history, tools))  # nothing dropped at this budget
        assert ex.target_ids[-1] == end_id and np.sum(ex.target_ids == end_id) == 1
        full = render_text(tok, rec["messages"][: ex.message_index + 1], tools, add_generation_prompt=False)
        text = tok.decode(np.concatenate([ex.prompt_ids, ex.target_ids]).tolist(), skip_special_tokens=False)
        assert full.startswith(text) and full[len(text):] == "\n"
        msg = rec["messages"][ex.message_index]
        if msg.get("tool_calls"):
            fn = msg["tool_calls"][0]["function"]
            assert f'"name": "{fn["name"]}"' in tok.decode(ex.target_ids.tolist())
    # the context budget protects system + task + schemas: below it every turn is skipped
    assert kd_examples(records, tok, max_prompt_tokens=1000) == []


def test_reasoning_is_imitated_only_when_the_student_thinks(tok, tmp_path):
    teacher = toy_teacher_backend(reasoning="first add two and three")
    with OpenAIServer(teacher) as srv:
        records = toy_trajectories(srv.base_url, toy_tasks(1))
    assert records[0]["messages"][2]["reasoning_content"] == "first add two and three"
    thinking = kd_examples(records, tok, max_prompt_tokens=512, enable_thinking=True)
    plain = kd_examples(records, tok, max_prompt_tokens=512, enable_thinking=False)
    assert len(thinking) == len(plain) == 2
    t_text = tok.decode(thinking[0].target_ids.tolist(), skip_special_tokens=False)
    p_text = tok.decode(plain[0].target_ids.tolist(), skip_special_tokens=False)
    assert t_text.startswith("<think>\nfirst add two and three\n</think>\n\n<tool_call>") and t_text.endswith(END)
    assert p_text.startswith("<tool_call>") and "think" not in p_text
    # without thinking the prompt carries the empty reasoning block the template pre-fills
    assert tok.decode(plain[0].prompt_ids.tolist()).endswith("<think>\n\n</think>\n\n")
    assert tok.decode(plain[1].target_ids.tolist(), skip_special_tokens=False) == TOY_ANSWER + END


def test_kd_source_order_depends_on_seed_and_step_only():
    exs = [KDExample(np.arange(3, dtype=np.int32) + i, np.array([i], np.int32), task_id=f"t{i}") for i in range(5)]
    a = KDGroupSource(exs, examples_per_step=3, seed=7)
    b = KDGroupSource(exs, examples_per_step=3, seed=7)
    steps = [a.step_indices(s) for s in range(4)]
    assert [b.step_indices(s) for s in (3, 1, 0, 2)] == [steps[3], steps[1], steps[0], steps[2]]
    flat = sum(steps, [])
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:10]) == list(range(5))  # epochs cover everything
    # two processes split a step's examples between them
    p0 = KDGroupSource(exs, examples_per_step=3, seed=7, process_index=0, process_count=2).collect(1)
    p1 = KDGroupSource(exs, examples_per_step=3, seed=7, process_index=1, process_count=2).collect(1)
    assert sorted(g.task_id for g in p0 + p1) == sorted(f"t{i}" for i in steps[1])
    with pytest.raises(ValueError, match="at least one example"):
        KDGroupSource([], examples_per_step=1, seed=0)


@pytest.fixture(scope="module")
def toy_examples(tok):
    with OpenAIServer(toy_teacher_backend()) as srv:
        records = toy_trajectories(srv.base_url, toy_tasks(4))
    return kd_examples(records, tok, max_prompt_tokens=512)


def test_kd_trains_through_the_trainer_only_target_tokens_carry_loss(tok, tok_dir, toy_examples, tmp_path):
    assert len(toy_examples) == 8  # 4 toy episodes x (tool call + answer)
    cfg = tiny_run_config(tok_dir, "model.init_seed=3", "train.lr=3e-3")
    result = run_kd(cfg, toy_examples, run_dir=tmp_path / "kd", steps=3, examples_per_step=8,
                    export_hf=tmp_path / "hf", tokenizer_dir=tok_dir)
    losses = result.losses
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses
    # step 0's loss is the mean NLL over target tokens only, computed by a direct forward of
    # the initial weights (prompt tokens in the mean would give a different number)
    initial = Qwen3(PRESETS["tiny"], rngs=nnx.Rngs(3))
    nll = np.concatenate([-direct_target_logprobs(initial, e.prompt_ids, e.target_ids) for e in toy_examples])
    assert result.metrics[0]["tokens"] == sum(e.target_ids.size for e in toy_examples)
    assert losses[0] == pytest.approx(float(nll.mean()), rel=1e-4)
    # the exported student is a loadable HF directory with the tokenizer next to it
    from actionopd_jax.model.weights import load_hf

    _, loaded = load_hf(result.hf_dir)
    lp_loaded = direct_target_logprobs(loaded, toy_examples[0].prompt_ids, toy_examples[0].target_ids)
    lp_trained = direct_target_logprobs(result.model(), toy_examples[0].prompt_ids, toy_examples[0].target_ids)
    np.testing.assert_allclose(lp_loaded, lp_trained, rtol=1e-5, atol=1e-5)
    assert load_tokenizer(result.hf_dir).convert_tokens_to_ids(END) == tok.convert_tokens_to_ids(END)
    lines = [json.loads(x) for x in (tmp_path / "kd" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]


def test_kd_through_actionopd_train_cli(tok_dir, tmp_path):
    """`actionopd train collect.kind=kd train.loss=kd kd.trajectories=FILE` runs and checkpoints."""
    from actionopd_jax.commands import train as cli

    with OpenAIServer(toy_teacher_backend()) as srv:
        toy_trajectories(srv.base_url, toy_tasks(2), out_jsonl=tmp_path / "traj.jsonl")
    run = tmp_path / "run"
    args = ["model.preset=tiny", f"model.tokenizer={tok_dir}", "train.steps=2", "train.minibatch_rows=8",
            "train.microbatch_rows=8", "train.lr=1e-3", "train.max_seq_len=1024", "collect.kind=kd", "train.loss=kd",
            f"kd.trajectories={tmp_path / 'traj.jsonl'}", "kd.examples_per_step=4", "run.progress=false",
            "run.tensorboard=false", "experiment.enabled=false", "--run-dir", str(run)]
    assert cli.main(args) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(x["loss"] > 0 and x["updates"] == 1 for x in lines)
    # a mismatched objective is a clear config error
    assert cli.main(["collect.kind=kd", "--check"]) == 2


class _ReferenceOrPartial:
    """Trial 0 replays the task's reference solution; trial 1 makes its first tool call and then
    answers as if done (a partly done episode)."""

    name = "reference-or-partial"

    def __init__(self):
        from actionopd_jax.eval.agents import ReferenceAgent

        self.reference, self.calls = ReferenceAgent(), {}

    async def act(self, obs, *, task, trial):
        from actionopd_jax.types import Message, ToolCall

        action = await self.reference.act(obs, task=task, trial=trial)
        if trial == 1 and isinstance(action, ToolCall):
            n = self.calls[task.task_id] = self.calls.get(task.task_id, 0) + 1
            if n > 1:
                return Message("All done.")
        return action


def test_kd_keeps_awm_and_envscaler_episodes_by_their_verifiers_success(tok, tmp_path):
    """KD's success filter (kd.is_successful, also what kd_fresh keeps) on real verifier
    outcomes of the mini pools: an EnvScaler episode that passes 1 of 2 checks (reward 0.5,
    success False) is dropped even at min_reward 0.5, an AWM episode the code verifier fails is
    dropped even at min_reward 0; the reference episodes (success True) are kept."""
    from pathlib import Path

    from actionopd_jax.baselines.kd import is_successful, teacher_trajectories
    from actionopd_jax.config import EnvConfig
    from actionopd_jax.envs.awm.factory import awm_env_factory
    from actionopd_jax.envs.awm.layout import load_awm
    from actionopd_jax.envs.envscaler.env import EnvScalerEnvironment
    from actionopd_jax.envs.envscaler.layout import load_envscaler
    from actionopd_jax.envs.sandbox import SubprocessSandbox

    data = Path(__file__).parent / "data"
    awm_task = next(t for t in load_awm(data / "awm_mini").tasks() if t.task_id == "library_loans_1/2")
    es_task = next(t for t in load_envscaler(data / "envscaler_mini").tasks() if t.task_id == "mini_locker_3")
    awm = awm_env_factory(EnvConfig(name="awm", awm_dir=str(data / "awm_mini"), mcp_pool_size=1),
                          cache_dir=str(tmp_path / "db"))
    sandbox = SubprocessSandbox()
    try:
        records = asyncio.run(teacher_trajectories(
            _ReferenceOrPartial(), [awm_task, es_task],
            lambda t: awm(t) if t.env == "awm" else EnvScalerEnvironment(sandbox),
            trials=2, concurrency=2, keep_successful=False, out_jsonl=tmp_path / "episodes.jsonl"))
    finally:
        awm.close()
    scores = {(r["task_id"], r["trial"]): r["score"] for r in records}
    assert (scores[("mini_locker_3", 1)]["reward"], scores[("mini_locker_3", 1)]["success"]) == (0.5, False)
    assert scores[("library_loans_1/2", 1)]["success"] is False
    assert scores[("library_loans_1/2", 1)]["verifier_mode"] == "code"
    assert all(scores[(t, 0)]["success"] is True for t in ("mini_locker_3", "library_loans_1/2"))
    for min_reward in (0.0, 0.5, 1.0):
        kept = [(r["task_id"], r["trial"]) for r in records if is_successful(r, min_reward)]
        assert kept == [("library_loans_1/2", 0), ("mini_locker_3", 0)], min_reward
    kept = load_trajectories(tmp_path / "episodes.jsonl", min_reward=0.5)
    assert sorted((r["task_id"], r["trial"]) for r in kept) == [("library_loans_1/2", 0), ("mini_locker_3", 0)]
    examples = kd_examples(kept, tok, max_prompt_tokens=8192)
    assert len(examples) == sum(1 for r in kept for m in r["messages"] if m["role"] == "assistant")
