"""KD's per-step schedule as paper B.4 runs it (baselines/kd_fresh.py): every step, kd.trials
fresh teacher episodes per task start, only the successful ones trained on, the target the
teacher's reasoning + action tokens, trained with the run's own optimizer / minibatch.

The teacher is a scripted policy on our loopback OpenAI-compatible server (real HTTP, the
`openai` client): with an even request seed it solves the toy task (add, then answer); with an
odd one it keeps calling the tool and the episode runs out of actions (reward 0)."""

import json

import pytest

from actionopd_jax.baselines.kd_fresh import FreshKDSource, rounds_of
from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer
from actionopd_jax.envs.tasks import TaskSource, TaskStream
from actionopd_jax.eval.agents import EndpointAgent
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice, tool_call_choice
from tests._baselines_fixtures import TOY_ANSWER, tiny_run_config, toy_env_factory, toy_tasks

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def seed_parity_teacher(seen: list):
    def reply(req):
        seen.append(req.seed)
        reasoning = f"seed {req.seed}"
        if req.seed % 2 == 0 and any(m.get("role") == "tool" for m in req.messages):
            return message_choice(TOY_ANSWER, reasoning=reasoning)
        choice = tool_call_choice("add", {"a": 2, "b": 3})
        choice.reasoning_content = reasoning
        return choice

    return ScriptedBackend("parity-teacher", reply)


def fresh_source(url, tok, tmp_path, *, thinking=True, starts=2):
    tasks = toy_tasks(starts)
    stream = TaskStream([(TaskSource("toy", tasks), starts)], seed=0)
    return FreshKDSource(lambda: EndpointAgent(url, "parity-teacher"), stream, toy_env_factory, tok,
                         out_dir=tmp_path / "kd", trials=4, min_reward=1.0, max_prompt_tokens=512,
                         enable_thinking=thinking, max_actions=3)


def test_each_step_asks_for_fresh_episodes_and_keeps_only_the_successful(tok, tmp_path):
    """2 task starts x 4 trials a step. Step 0 sends seeds 0-3, step 1 seeds 4-7 (fresh); the
    even seeds succeed: 2 of 4 per start -> 4 kept episodes x 2 turns = 8 examples a step.
    Teacher samples: 4 successful x 2 turns + 4 failed x 3 turns (max_actions 3) = 20 a step."""
    seen: list = []
    with OpenAIServer(seed_parity_teacher(seen)) as srv:
        source = fresh_source(srv.base_url, tok, tmp_path)
        step0 = source.collect(0)
        seeds0, m0 = sorted(set(seen)), source.metrics()
        seen.clear()
        step1 = source.collect(1)
        seeds1, m1 = sorted(set(seen)), source.metrics()
    assert seeds0 == [0, 1, 2, 3] and seeds1 == [4, 5, 6, 7]
    for m in (m0, m1):
        assert (m["kd/task_starts"], m["kd/episodes"], m["kd/episodes_kept"], m["kd/examples"]) == (2, 8, 4, 8)
        assert m["kd/teacher_samples"] == 20
    assert len(step0) == len(step1) == 8 and source.teacher_samples == 40 and source.episodes == 16
    assert all(g.retained and len(g.candidates) == 1 for g in step0 + step1)
    # the targets are the teacher's reasoning + action through the end-of-turn token, nothing of the prompt
    texts0 = [tok.decode(g.candidates[0].token_ids.tolist(), skip_special_tokens=False) for g in step0]
    texts1 = [tok.decode(g.candidates[0].token_ids.tolist(), skip_special_tokens=False) for g in step1]
    assert texts0[0] == ('<think>\nseed 0\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}'
                         '\n</tool_call>' + END)
    assert texts0[1] == "<think>\nseed 0\n</think>\n\n" + TOY_ANSWER + END
    assert {t.split("\n")[1] for t in texts0} == {"seed 0", "seed 2"}  # odd seeds failed: not trained on
    assert {t.split("\n")[1] for t in texts1} == {"seed 4", "seed 6"}  # step 1's own fresh episodes
    prompt = tok.decode(step0[0].prompt_ids.tolist())
    assert prompt.endswith("<|im_start|>assistant\n") and "seed 0" not in prompt
    # each step's episodes are on disk; the state resumes the stream and the counters
    assert sorted(p.name for p in (tmp_path / "kd").iterdir()) == ["step-00000-p0-r0.jsonl", "step-00001-p0-r0.jsonl"]
    state = json.loads(json.dumps(source.state_dict()))
    assert state["next_step"] == 2 and state["teacher_samples"] == 40


def test_repeated_starts_in_a_step_get_their_own_episodes():
    a, b = toy_tasks(2)
    assert [[t.task_id for t in r] for r in rounds_of([a, b, a, a])] == [["toy-kd-0", "toy-kd-1"], ["toy-kd-0"],
                                                                         ["toy-kd-0"]]


def test_fresh_kd_trains_with_the_run_optimizer_one_update_per_minibatch(tok, tok_dir, tmp_path):
    """Through the trainer, one step: 4 starts -> 16 examples a step with train.minibatch_rows=8 -> 2
    updates a step, as an ActionOPD step with 16 rows; the loss is over target tokens only."""
    from actionopd_jax.baselines.kd import kd_config
    from actionopd_jax.train.loop import Trainer

    cfg = kd_config(tiny_run_config(tok_dir, "train.steps=1",
                                    "collect.enable_thinking=true", "checkpoint.every_steps=0"))
    seen: list = []
    with OpenAIServer(seed_parity_teacher(seen)) as srv:
        source = fresh_source(srv.base_url, tok, tmp_path / "src", starts=4)
        trainer = Trainer(cfg, run_dir=tmp_path / "run", source=source)
        try:
            m = trainer.train_step()
        finally:
            trainer.close()
    assert m["updates"] == 2 and m["collect/kd/examples"] == 16 and m["loss"] > 0
    assert m["tokens"] == m["collect/kd/target_tokens"]


def test_kd_on_tau2_draws_eight_starts_per_domain_each_step(tok, tmp_path):
    """Paper B.4 on tau2: 8 task starts per domain per step, each with kd.trials fresh teacher
    episodes. The shipped tau2 recipe with collect.kind=kd, wired as a run wires it
    (build_kd_source: the run's task stream, sharded over processes). The tau2 episodes need
    the teacher and user-simulator endpoints, which cannot run here, so `episodes_of` is
    replaced by a recorder of the starts each step asks episodes for (and no episodes)."""
    from collections import Counter

    from actionopd_jax.baselines.wiring import build_kd_source
    from actionopd_jax.collect.source import train_task_stream
    from actionopd_jax.config.load import load_config
    from actionopd_jax.train.sources import SourceContext

    cfg = load_config("configs/paper/tau2_qwen3_4b_h200.yaml", ["collect.kind=kd", "train.loss=kd"])
    asked: dict[tuple[int, int], list] = {}
    sources = []
    for p in range(2):  # two processes: each runs its share of the same global starts
        ctx = SourceContext(model_config=None, run_dir=str(tmp_path / "run"), tokenizer_path="", process_index=p,
                            process_count=2)
        src = build_kd_source(cfg, ctx, tokenizer=tok, make_agent=lambda: None)
        assert isinstance(src, FreshKDSource) and src.trials == 4
        src.episodes_of = lambda step, starts, p=p: asked.setdefault((step, p), list(starts)) and []
        sources.append(src)
    reference = train_task_stream(cfg)  # the run's global list of starts, step by step
    for step in range(3):
        for src in sources:
            assert src.collect(step) == []
        starts = asked[(step, 0)] + asked[(step, 1)]
        assert Counter(t.env for t in starts) == {"tau2_airline": 8, "tau2_retail": 8, "tau2_telecom": 8}, step
        key = lambda t: (t.env, t.task_id)  # noqa: E731
        assert sorted(map(key, starts)) == sorted(map(key, reference.next_step()))  # the shares split one list
        assert sources[0].metrics()["kd/task_starts"] == len(asked[(step, 0)]) == 12
    assert [t.task_id for t in asked[(0, 0)]] != [t.task_id for t in asked[(1, 0)]]  # new starts each step
