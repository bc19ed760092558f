"""The collector on the real BFCL multi-turn environment: real tool schemas in the prompt,
real tool execution and scoring, the privileged reference teacher (serve.reference_backend:
it answers with the dataset's ground-truth calls) and the LLM judge behind our loopback
server. The student's two replies at every state are fixed texts -- a message to the user
and an unparsable reply -- because BFCL prompts (thousands of tokens of tool schemas) are too
long for a model on this CPU-only test machine; the real sampler is exercised by
test_collect_runs.py. Rewards by hand: the message is a valid action that does not match the
teacher's tool call (0), the unparsable reply is invalid (-1); so every group is retained,
commits the message, and the message ends the BFCL turn: each episode runs turn by turn to
its end and is scored by the official checker."""

import numpy as np

from actionopd_jax.envs.bfcl_data import bfcl_tasks, load_entry
from actionopd_jax.sampling import Generation
from actionopd_jax.serve.reference_backend import MODEL_NAME, ReferenceBackend
from actionopd_jax.types import Invalid, Message, ToolCall
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (BAD, collect_once, collector_config, judge_backend, make_matcher, make_teacher,
                                     serve, student_text)

REPLY = Message("I have finished what you asked.")


def constant_sample_fn(tokenizer, actions, eos):
    def run(prompts, keys):
        out = []
        for _ in prompts:
            gens = []
            for a in actions:
                ids = tokenizer.encode(student_text(a), add_special_tokens=False) + [eos]
                gens.append(Generation(np.asarray(ids, np.int32), np.full(len(ids), -1.0, np.float32), "stop"))
            out.append(gens)
        return out

    return run


def test_bfcl_collection_with_the_reference_teacher(tiny_tokenizer):
    from actionopd_jax.collect import Collector, default_env_factory

    tasks = bfcl_tasks(["base"])[:3]
    turns = {t.task_id: len(load_entry(t.task_id)["question"]) for t in tasks}
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = collector_config(n=2, max_prompt_tokens=12000, decision_limits=(("bfcl", None),), env_timeout_s=30.0)
    with serve(ReferenceBackend(tasks), judge_backend()) as server:
        collector = Collector(cfg, tokenizer=tiny_tokenizer, teacher=make_teacher(server, model=MODEL_NAME),
                              matcher=make_matcher(server), eos_ids=[eos], env_factory=default_env_factory(),
                              sample_fn=constant_sample_fn(tiny_tokenizer, [REPLY, BAD], eos))
        result = collect_once(collector, tasks, step=0, process_index=0, process_count=1)
    assert len(result.trajectories) == 3
    for rec in result.trajectories:
        # one decision per turn: the committed message ends each turn; the last one ends the episode
        assert rec.end_reason == "env_done" and rec.decisions == turns[rec.task_id], rec
        assert rec.score["end_reason"] == "completed" and rec.score["turns_completed"] == turns[rec.task_id]
        assert rec.score["reward"] == 0.0  # no tool was ever called: the checker fails it
    assert len(result.groups) == sum(turns.values())
    for g in result.groups:
        assert 3000 < g.prompt_ids.size <= 12000  # full tool schemas are in every prompt
        assert [type(s.action) for s in g.teacher_samples] == [ToolCall] * 3  # the reference's first call of the turn
        assert isinstance(g.candidates[0].action, Message) and isinstance(g.candidates[1].action, Invalid)
        assert [c.reward for c in g.candidates] == [0.0, -1.0]
        assert g.retained and g.committed_index == 0
    assert result.metrics.teacher.http_calls == len(result.groups)
    assert result.metrics.matcher["judge_calls"] == 0  # cross-kind and invalid pairs never need the judge
