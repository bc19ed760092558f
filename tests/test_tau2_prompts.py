"""tau2 evaluation runs on tau2's own harness prompts (issue 43 item 4): the agent's system
prompt and the user simulator's are exactly what tau2's own runner (`tau2.run.run_task`) builds
for the same task, through the package's registry and classes; ours stay a named option
(`--tau2-prompts actionopd`, `eval.tau2_prompts`), recorded in settings.json. The user and the
evaluated agent are scripted backends behind our real OpenAI-compatible server, reached with the
real `openai` client."""

from __future__ import annotations

import json

import pytest
from _envs_fixtures import USER_MODEL, run, start_user_server

from actionopd_jax.envs.tau2_env import AGENT_INSTRUCTIONS, Tau2Env
from actionopd_jax.envs.tau2_prompts import harness_module
from actionopd_jax.envs.tau2_tasks import tau2_task, tau2_tasks
from actionopd_jax.envs.user_sim import UserSimConfig, UserSimulator
from actionopd_jax.eval.cli import main as eval_main
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice


@pytest.fixture(scope="module")
def user():
    server, backend = start_user_server()
    yield UserSimulator(UserSimConfig(base_url=server.base_url, model=USER_MODEL, max_retries=0)), backend
    server.stop()


def tau2_runner_prompts(domain: str, tau2_id: str) -> tuple[str, str, list, list | None]:
    """(agent system prompt, user system prompt, agent tools, user tools) as tau2.run.run_task
    builds them: the registry's environment, agent and user constructors, called as it calls them."""
    registry = harness_module("tau2.registry").registry
    task = tau2_task(domain, tau2_id)
    environment = registry.get_env_constructor(domain)()
    agent = registry.get_agent_constructor("llm_agent")(tools=environment.get_tools(),
                                                        domain_policy=environment.get_policy())
    try:
        user_tools = environment.get_user_tools()
    except Exception:
        user_tools = None
    simulator = registry.get_user_constructor("user_simulator")(tools=user_tools, instructions=str(task.user_scenario))
    return (agent.get_init_state().system_messages[0].content, simulator.get_init_state().system_messages[0].content,
            [t.openai_schema for t in environment.get_tools()],
            None if user_tools is None else [t.openai_schema for t in user_tools])


@pytest.mark.parametrize("domain", ["airline", "retail", "telecom"])
def test_tau2_prompts_equal_what_tau2s_own_runner_builds(user, domain):
    sim, backend = user
    task = tau2_tasks(domain, "test")[0]
    agent_prompt, user_prompt, tools, user_tools = tau2_runner_prompts(domain, task.payload["tau2_id"])
    before = len(backend.requests)
    obs = run(Tau2Env(domain, user_sim=sim, prompts="tau2").reset(task))
    assert obs.messages[0] == {"role": "system", "content": agent_prompt}
    assert "<policy>" in agent_prompt and "<instructions>" in agent_prompt  # tau2's layout, not ours
    assert obs.tools == tools
    # what the user endpoint was sent: tau2's user prompt, and its device tools where it has them
    first = backend.requests[before]
    assert first.messages[0] == {"role": "system", "content": user_prompt}
    assert (first.tools or None) == user_tools
    # ours remain the option with a name
    obs = run(Tau2Env(domain, user_sim=sim, prompts="actionopd").reset(task))
    assert obs.messages[0]["content"].startswith(AGENT_INSTRUCTIONS)
    assert backend.requests[-1].messages[0]["content"] != user_prompt


def test_unknown_prompts_are_refused():
    with pytest.raises(ValueError, match="'tau2' .* or 'actionopd'"):
        Tau2Env("airline", prompts="mine")


def test_eval_command_uses_tau2s_prompts_by_default_and_records_the_choice(tmp_path):
    task = tau2_tasks("airline", "test")[0]
    agent_prompt, user_prompt, _, _ = tau2_runner_prompts("airline", task.payload["tau2_id"])
    student = ScriptedBackend("student", lambda req: message_choice("Could you give me your user id?"))
    said = []

    def reply(req):
        said.append(req)
        return message_choice("I want to know my reservations." if len(said) % 2 else "###STOP###")

    user_backend = ScriptedBackend("user", reply)
    with OpenAIServer([student, user_backend]) as server:
        common = ["--endpoint", server.base_url, "--model", "student", "--settings", "student", "--provider",
                  "actionopd", "--bench", "tau2_airline:test", "--limit", "1", "--trials", "1", "--user-sim-url",
                  server.base_url, "--user-sim-model", "user", "--user-sim-provider", "actionopd", "--no-progress"]
        assert eval_main(common + ["--out", str(tmp_path / "tau2")]) == 0
        assert student.requests[0].messages[0]["content"] == agent_prompt
        assert user_backend.requests[0].messages[0]["content"] == user_prompt
        assert eval_main(common + ["--out", str(tmp_path / "ours"), "--tau2-prompts", "actionopd"]) == 0
        assert student.requests[-1].messages[0]["content"].startswith(AGENT_INSTRUCTIONS)
        # a directory scored on one set of prompts does not take episodes played on the other
        assert eval_main(common + ["--out", str(tmp_path / "tau2"), "--tau2-prompts", "actionopd",
                                   "--trials", "2"]) == 2
    assert json.loads((tmp_path / "tau2" / "settings.json").read_text())["tau2_prompts"] == "tau2"
    assert json.loads((tmp_path / "ours" / "settings.json").read_text())["tau2_prompts"] == "actionopd"
    assert "tau2's own agent and user prompts" in (tmp_path / "tau2" / "report.md").read_text()
