"""Native parallel tool calls in evaluation (issue 43 item 3): an endpoint that answers with
several tool calls in one reply has all of them run, in order, each result back under its call
id, and scores as the same calls made one per reply; metrics count replies and calls apart.
The agent is a scripted backend behind our real OpenAI-compatible server on 127.0.0.1, reached
with the real `openai` client; BFCL and tau2 are the real packages' tasks and scorers, the tau2
user is the scripted simulator of tests/_envs_fixtures.py, also over real HTTP."""

from __future__ import annotations

import asyncio
import json

import pytest
from _envs_fixtures import USER_MODEL, start_user_server

from actionopd_jax.envs.bfcl import BFCLEnv
from actionopd_jax.envs.reference import reference_policy
from actionopd_jax.envs.tau2_env import Tau2Env
from actionopd_jax.envs.tau2_tasks import tau2_tasks
from actionopd_jax.envs.user_sim import UserSimConfig, UserSimulator
from actionopd_jax.eval.agents import EndpointAgent
from actionopd_jax.eval.metrics import summarize
from actionopd_jax.eval.runner import run_eval
from actionopd_jax.eval.tasks import select_tasks
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.requests import ChatChoice
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.types import Observation, ToolCall


def _reference_backend(task, model: str, *, per_reply: int) -> ScriptedBackend:
    """The task's reference policy as an endpoint that puts up to `per_reply` of its next
    calls into one reply (each with its own id), as a model with parallel calls would."""
    policy = reference_policy(task)

    def reply(req):
        messages, calls = list(req.messages), []
        while len(calls) < per_reply:
            action = policy.next_action(Observation(messages=messages, tools=req.tools or []))
            if not isinstance(action, ToolCall):
                break
            call = {"id": f"call_{task.task_id.replace('/', '_')}_{len(req.messages)}_{len(calls)}", "type": "function",
                    "function": {"name": action.name, "arguments": json.dumps(action.arguments)}}
            calls.append(call)
            # what the history will hold once this call has run: the policy then names the next
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": ""}]
        return ChatChoice(content=None, tool_calls=calls) if calls else message_choice(action.text)

    return ScriptedBackend(model, reply)


def _evaluate(task, make_env, per_reply: int, tmp_path):
    backend = _reference_backend(task, f"ref-{per_reply}", per_reply=per_reply)
    with OpenAIServer(backend) as srv:
        agent = EndpointAgent(srv.base_url, backend.model_name)
        records, errors = asyncio.run(run_eval(agent, [task], make_env, tmp_path / f"{per_reply}.jsonl",
                                               progress=False, record_conversation=True))
    assert errors == []
    (record,) = records
    return record, backend


def _check_call_ids(messages):
    """Every assistant call is answered, in order, by one tool message carrying its id."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") or []
        if calls:
            answers = messages[i + 1 : i + 1 + len(calls)]
            assert [a["role"] for a in answers] == ["tool"] * len(calls)
            assert [a["tool_call_id"] for a in answers] == [c["id"] for c in calls]
            assert len({c["id"] for c in calls}) == len(calls)


def _assert_same_score(single, parallel):
    assert parallel["score"]["reward"] == single["score"]["reward"] == 1.0, (single["score"], parallel["score"])
    assert parallel["tool_calls"] == single["tool_calls"] > 0
    assert parallel["actions"] < single["actions"]  # fewer replies, the same calls
    assert parallel["parallel_replies"] >= 1 and single["parallel_replies"] == 0
    _check_call_ids(parallel["messages"])
    # metrics: replies and calls apart
    (row,) = summarize([parallel])
    assert row["replies"] == parallel["actions"] and row["tool_calls"] == parallel["tool_calls"]


def test_bfcl_two_parallel_calls_score_like_the_same_calls_one_per_reply(tmp_path):
    task = next(t for t in select_tasks("bfcl:base", limit=4) if t.task_id == "multi_turn_base_1")
    single, _ = _evaluate(task, lambda t: BFCLEnv(), 1, tmp_path)
    parallel, backend = _evaluate(task, lambda t: BFCLEnv(), 2, tmp_path)
    _assert_same_score(single, parallel)
    assert parallel["score"]["official"] == single["score"]["official"] == 1.0
    # the history the endpoint was shown holds one assistant message with both calls
    assert any(len(m.get("tool_calls") or []) == 2 for m in backend.requests[-1].messages)


@pytest.fixture(scope="module")
def user_sim():
    server, _ = start_user_server()
    yield UserSimulator(UserSimConfig(base_url=server.base_url, model=USER_MODEL, max_retries=0))
    server.stop()


def test_tau2_two_parallel_calls_score_like_the_same_calls_one_per_reply(tmp_path, user_sim):
    # airline/22: three reservation writes; the first two go out in one reply
    task = next(t for t in tau2_tasks("airline", "test") if t.task_id == "airline/22")
    make_env = lambda t: Tau2Env("airline", user_sim=user_sim)  # noqa: E731
    single, _ = _evaluate(task, make_env, 1, tmp_path)
    parallel, backend = _evaluate(task, make_env, 2, tmp_path)
    _assert_same_score(single, parallel)
    assert parallel["tool_calls"] == 3 and parallel["parallel_replies"] == 1
    # what the agent saw next: one assistant message with both calls, then both results
    later = backend.requests[-1].messages
    two = next(i for i, m in enumerate(later) if len(m.get("tool_calls") or []) == 2)
    assert [m["role"] for m in later[two + 1 : two + 3]] == ["tool", "tool"]
    assert not any(m["content"].startswith("Error") for m in later if m["role"] == "tool")


def test_kd_teacher_keeps_the_single_action_rule(tmp_path):
    """KD's teacher episodes become training targets: its agent reads a two-call reply as
    one Invalid reply (asked again, teacher.retries), never as two actions."""
    from actionopd_jax.baselines.wiring import endpoint_agent
    from actionopd_jax.config.load import load_config
    from actionopd_jax.types import Invalid

    task = next(t for t in select_tasks("bfcl:base", limit=4) if t.task_id == "multi_turn_base_0")  # 3 calls in turn 1
    backend = _reference_backend(task, "ref-2", per_reply=2)
    with OpenAIServer(backend) as srv:
        cfg = load_config(None, ["teacher.kind=openai", f"teacher.base_url={srv.base_url}", "teacher.model=ref-2",
                                 "teacher.api_key_env=", "teacher.provider=vllm", "teacher.retries=1"])
        agent = endpoint_agent(cfg)
        env = BFCLEnv()

        async def first_reply():
            obs = await env.reset(task)
            return await agent.act(obs, task=task, trial=0)

        action = asyncio.run(first_reply())
    assert agent.parallel_calls is False
    assert isinstance(action, Invalid) and "more than one tool call" in action.reason
    assert len(backend.requests) == 2  # asked again once, as an unparsable teacher reply is
