"""The tau2 user simulator against our real OpenAI-compatible server (scripted backends, real
`openai` client): prompt construction, role flipping, stop / transfer / out-of-scope signals,
API keys from the environment, and endpoint failures that are retried, then unavailable."""

from __future__ import annotations

import asyncio

import pytest
from _envs_fixtures import USER_MODEL, run, start_user_server

from actionopd_jax.envs.tau2_env import GREETING, Tau2Env
from actionopd_jax.envs.tau2_tasks import tau2_task, tau2_tasks
from actionopd_jax.envs.user_sim import (
    OUT_OF_SCOPE,
    STOP,
    TRANSFER,
    UserSimConfig,
    UserSimulator,
    UserSimUnavailable,
    build_user_system_prompt,
)
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice, tool_call_choice
from actionopd_jax.types import Message, ToolCall


def _airline_task(tau2_id="0"):
    return next(t for t in tau2_tasks("airline", "base") if t.payload["tau2_id"] == tau2_id)


def test_prompt_is_built_from_the_scenario():
    scenario = tau2_task("retail", "0").user_scenario
    prompt = build_user_system_prompt(scenario, with_tools=False)
    ins = scenario.instructions
    for text in (ins.reason_for_call, ins.known_info, ins.unknown_info, ins.task_instructions):
        assert text.strip() in prompt
    for signal in (STOP, TRANSFER, OUT_OF_SCOPE):
        assert signal in prompt
    assert "tools" not in prompt.lower()
    with_tools = build_user_system_prompt(scenario.model_dump(), with_tools=True)
    assert "You have tools" in with_tools and ins.known_info.strip() in with_tools
    assert build_user_system_prompt({"persona": "A calm engineer.", "instructions": "Ask for a refund."}, with_tools=False).count("## ") == 2


@pytest.mark.parametrize("signal,reason", [(STOP, "user_signal:stop"), (TRANSFER, "user_signal:transfer"), (OUT_OF_SCOPE, "user_signal:out-of-scope")])
def test_each_signal_ends_the_episode(signal, reason):
    def reply(req):
        return message_choice("I want to change my flight.") if req.messages[-1]["content"] == GREETING else message_choice(f"Thanks. {signal}")

    server, _ = start_user_server(reply)
    try:
        sim = UserSimulator(UserSimConfig(base_url=server.base_url, model=USER_MODEL, max_retries=0))

        async def main():
            env = Tau2Env("airline", user_sim=sim)
            obs = await env.reset(_airline_task())
            assert not obs.done and obs.messages[-1] == {"role": "user", "content": "I want to change my flight."}
            obs, done = await env.step(Message("Could you give me your user id?"))
            return obs, done, await asyncio.to_thread(env.score)

        obs, done, score = run(main())
    finally:
        server.stop()
    assert done and obs.info["end_reason"] == reason and score["termination"] == "user_stop"
    assert obs.messages[-1]["content"] == f"Thanks. {signal}"


def test_roles_are_flipped_and_device_tool_results_come_back(monkeypatch):
    """Telecom: the simulator sees agent messages as `user`, its own as `assistant`, and the
    results of its device tools as `tool` messages."""
    seen = []

    def reply(req):
        seen.append(req)
        last = req.messages[-1]
        if last["role"] == "tool":
            return message_choice("<think>let me read it</think>The status bar shows something.")
        if last["content"] == GREETING:
            return message_choice("My mobile data does not work.")
        if "status bar" in last["content"]:
            return tool_call_choice("check_status_bar", {})
        return message_choice(STOP)

    server, _ = start_user_server(reply)
    try:
        sim = UserSimulator(UserSimConfig(base_url=server.base_url, model=USER_MODEL, max_retries=0))

        async def main():
            env = Tau2Env("telecom", user_sim=sim)
            await env.reset(tau2_tasks("telecom", "train")[0])
            obs, _ = await env.step(Message("What does your status bar show?"))
            return obs

        obs = run(main())
    finally:
        server.stop()
    assert obs.messages[-1] == {"role": "user", "content": "The status bar shows something."}  # reasoning stripped
    final = seen[-1]
    roles = [m["role"] for m in final.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert final.messages[3]["content"] == "What does your status bar show?"
    assert final.messages[4]["tool_calls"][0]["function"]["name"] == "check_status_bar"
    assert final.tools and "check_status_bar" in {t["function"]["name"] for t in final.tools}
    assert not any("check_status_bar" in str(m) for m in obs.messages[1:])  # unseen by the agent


def test_api_key_comes_from_the_named_environment_variable(monkeypatch):
    monkeypatch.setenv("ACTIONOPD_TEST_SERVER_KEY", "s3cret-key")
    backend = ScriptedBackend(USER_MODEL, lambda req: message_choice("hello"))
    server = OpenAIServer(backend, api_key_env="ACTIONOPD_TEST_SERVER_KEY")
    server.start()
    try:
        async def ask(env_name):
            sim = UserSimulator(UserSimConfig(base_url=server.base_url, model=USER_MODEL, api_key_env=env_name, max_retries=0))
            return await sim.reply("sys", [{"role": "user", "content": "hi"}])

        monkeypatch.setenv("ACTIONOPD_TEST_USER_KEY", "s3cret-key")
        assert run(ask("ACTIONOPD_TEST_USER_KEY")).text == "hello"
        monkeypatch.setenv("ACTIONOPD_TEST_USER_KEY", "wrong")
        with pytest.raises(UserSimUnavailable, match=r"AuthenticationError\): HTTP 401"):
            run(ask("ACTIONOPD_TEST_USER_KEY"))
        monkeypatch.delenv("ACTIONOPD_TEST_USER_KEY")
        with pytest.raises(UserSimUnavailable, match="ACTIONOPD_TEST_USER_KEY.*not set") as info:
            run(ask("ACTIONOPD_TEST_USER_KEY"))
        assert "s3cret" not in str(info.value)
    finally:
        server.stop()


def test_simulator_failures_are_retried_then_unavailable_never_a_scored_end():
    """Issue 43 item 1: a user endpoint that fails is retried as the teacher's requests are
    (teacher/transport.py), then the episode raises UserSimUnavailable naming the endpoint: it
    was a finished episode with termination user_error and reward 0."""
    calls = {"n": 0}

    async def flaky(body):
        if body.get("model") != USER_MODEL:
            return None
        calls["n"] += 1
        if calls["n"] == 2 or calls["n"] >= 4:   # the 2nd request fails once; from the 4th on, always
            return 500, {"error": {"message": "boom", "type": "server_error", "code": None}}, {}
        return None

    backend = ScriptedBackend(USER_MODEL, lambda req: message_choice("I need help with a booking."))
    server = OpenAIServer(backend, middleware=flaky)
    server.start()
    try:
        sim = UserSimulator(UserSimConfig(base_url=server.base_url, model=USER_MODEL, max_retries=2,
                                          retry_base_delay_s=0.0))

        async def main():
            env = Tau2Env("airline", user_sim=sim)
            obs = await env.reset(_airline_task())                        # request 1
            obs, done = await env.step(Message("Sure, what is your user id?"))   # 2 fails, 3 answers
            assert not done and obs.messages[-1]["content"] == "I need help with a booking."
            await env.step(Message("And your booking code?"))             # 4, 5, 6 fail

        with pytest.raises(UserSimUnavailable) as err:
            run(main())
        assert calls["n"] == 6
        text = str(err.value)
        assert server.base_url in text and USER_MODEL in text and "InternalServerError" in text and "3 attempt" in text
        assert err.value.where == f"user simulator endpoint {server.base_url} (model {USER_MODEL})"
        # Unknown model: a 404 is not retried (repeating it only costs), and is no scored end either.
        wrong = UserSimulator(UserSimConfig(base_url=server.base_url, model="nope", max_retries=2,
                                            retry_base_delay_s=0.0))
        with pytest.raises(UserSimUnavailable, match="HTTP 404"):
            run(Tau2Env("airline", user_sim=wrong).reset(_airline_task()))
    finally:
        server.stop()


def test_a_simulator_that_only_calls_tools_is_cut_off():
    server, _ = start_user_server(lambda req: tool_call_choice("check_status_bar", {}))
    try:
        sim = UserSimulator(UserSimConfig(base_url=server.base_url, model=USER_MODEL, max_retries=0))
        obs = run(Tau2Env("telecom", user_sim=sim, max_user_tool_rounds=3).reset(tau2_tasks("telecom", "train")[0]))
    finally:
        server.stop()
    assert obs.done and obs.info["end_reason"] == "user simulator kept calling tools"


def test_config_validation():
    with pytest.raises(ValueError, match="base_url and model"):
        UserSimulator(UserSimConfig(base_url="", model="m"))
    # a sampling setting the provider cannot send is refused, never dropped (table 8: k=20, thinking off)
    url = "http://127.0.0.1:9/v1"
    with pytest.raises(ValueError, match=r"user simulator.top_k=20 cannot be sent to provider 'openai'"):
        UserSimulator(UserSimConfig(base_url=url, model="m", top_k=20))
    with pytest.raises(ValueError, match="unknown provider 'nope'"):
        UserSimulator(UserSimConfig(base_url=url, model="m", provider="nope"))
    UserSimulator(UserSimConfig(base_url=url, model="m", provider="vllm", top_k=20, thinking=False))
    with pytest.raises(ValueError, match="needs a user simulator"):
        run(Tau2Env("airline").reset(_airline_task()))
    with pytest.raises(ValueError, match="unknown tau2 domain"):
        Tau2Env("banking")
    with pytest.raises(ValueError, match="got a task for"):
        run(Tau2Env("retail", user_sim=UserSimulator(UserSimConfig(base_url="http://127.0.0.1:9/v1", model="m"))).reset(_airline_task()))


def test_env_step_rejects_non_actions():
    from actionopd_jax.envs.registry import make_environment

    env = make_environment("bfcl")
    with pytest.raises(TypeError, match="ToolCall, ToolCalls, Message or Invalid"):  # BFCL plays parallel calls
        run(env.step({"name": "ls"}))
    with pytest.raises(ValueError, match="unknown environment"):
        make_environment("webshop")
    assert make_environment("tau2_retail", user_sim=None).name == "tau2_retail"
    assert isinstance(ToolCall("a", {}), ToolCall)
