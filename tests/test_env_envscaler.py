"""EnvScaler episodes (`env.name: envscaler`) on our mini data (tests/data/envscaler_mini): the
class instance in its sandboxed process, scripted correct / partly wrong / wrong episodes scored
by the scenario's check functions, schema and method errors that the episode survives, process
faults that end it with a reason, a conversational task played with our user simulator over a
real HTTP server, the matcher's per-environment tool evidence, and the pool factory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _envs_fixtures import run

from actionopd_jax.config import ConfigError, EnvConfig, MatcherConfig
from actionopd_jax.envs.envscaler.env import EnvScalerEnvironment, EnvScalerFault, EpisodeConfig
from actionopd_jax.envs.envscaler.layout import load_envscaler
from actionopd_jax.envs.envscaler.user import GREETING
from actionopd_jax.envs.reference import ENVSCALER_DONE, reference_policy
from actionopd_jax.envs.sandbox import SubprocessSandbox
from actionopd_jax.envs.user_sim import STOP, UserSimConfig, UserSimulator
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.types import Invalid, Message, Task, ToolCall

ES = Path(__file__).parent / "data" / "envscaler_mini"


@pytest.fixture(scope="module")
def tasks() -> dict[str, Task]:
    return {t.task_id: t for t in load_envscaler(ES).tasks()}


@pytest.fixture(scope="module")
def sandbox():
    return SubprocessSandbox()


async def _play(env, task, actions):
    obs = await env.reset(task)
    done = obs.done
    for a in actions:
        if done:
            break
        obs, done = await env.step(a)
    return obs, done


def _score(env, task, actions):
    obs, done = run(_play(env, task, actions))
    return obs, done, env.score()


def test_scripted_correct_partly_wrong_and_wrong_episodes_are_scored_by_the_checks(tasks, sandbox):
    env = EnvScalerEnvironment(sandbox)
    t = tasks["mini_locker_3"]  # two checks: both of Nora's parcels in lockers; P9 untouched
    right = [ToolCall("assign_parcel", {"parcel_id": "P7", "locker_id": "L1"}),
             ToolCall("assign_parcel", {"parcel_id": "P8", "locker_id": "L3"}), Message("Both are in lockers.")]
    obs, done, s = _score(env, t, right)
    assert done and s["end_reason"] == "completed" and s["reward"] == 1.0 and s["success"] is True
    assert [m["role"] for m in obs.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert obs.messages[1]["content"] == t.payload["task"] and "parcel lockers" in obs.messages[0]["content"]
    assert json.loads(obs.messages[3]["content"].replace("'", '"').replace("True", "true")) == \
        {"success": True, "message": "P7 is in L1"}  # str() of the method's result, as upstream shows it
    # only P7: check 1 fails, check 2 passes -> 1/2
    _, _, s = _score(env, t, right[:1] + right[2:])
    assert (s["reward"], s["success"]) == (0.5, False)
    assert [c["passed"] for c in s["checks"]] == [False, True]
    # P9 moved out (collected) and nothing else: both checks fail -> 0
    _, _, s = _score(env, t, [ToolCall("mark_collected", {"parcel_id": "P9"}), Message("done")])
    assert (s["reward"], s["success"]) == (0.0, False)
    # each episode starts from the scenario's initial state again
    obs, _, s = _score(env, tasks["mini_locker_1"], [ToolCall("list_free_lockers", {"site": "Harbour St"})])
    assert "['L1']" in obs.messages[-1]["content"]


def test_schema_errors_and_raising_methods_are_tool_errors_the_episode_survives(tasks, sandbox):
    env = EnvScalerEnvironment(sandbox)
    t = tasks["mini_clinic_1"]
    obs, done, s = _score(env, t, [
        ToolCall("book_slot", {"slot": "S3"}),                         # unknown parameter: never executed
        ToolCall("drop_table", {}),                                    # not a tool of this environment
        ToolCall("book_slot", {"slot_id": ["S3"], "patient": "Tom Berg"}),  # the method raises (unhashable)
        ToolCall("book_slot", {"slot_id": "S3", "patient": "Tom Berg"}),
        Message("Booked.")])
    tool_texts = [m["content"] for m in obs.messages if m["role"] == "tool"]
    assert tool_texts[0].startswith("Error:") and "slot" in tool_texts[0]
    assert tool_texts[1].startswith("Error:") and "not available" in tool_texts[1]
    assert tool_texts[2].startswith("Error: TypeError") and "unhashable" in tool_texts[2]
    assert "booked A1" in tool_texts[3]
    assert s["tool_calls"] == 4 and s["tool_errors"] == 3 and s["success"] and s["end_reason"] == "completed"
    # an unparsable reply ends the episode; the checks still score the state it left
    _, done, s = _score(env, t, [Invalid("no action")])
    assert done and s["end_reason"] == "invalid_reply" and s["reward"] == 0.0 and "checks" in s


HOSTILE = '''
import os, sys, time
class Hostile:
    def __init__(self, init_config):
        self.n = 0
    def die(self):
        os._exit(3)
    def hang(self):
        time.sleep(60)
    def env_key(self):
        return os.environ.get("OPENAI_API_KEY", "absent")
    def half_reply(self):  # the start of a reply line on the reply channel, then silence
        sys.__stdout__.write('{"ok": true, "value": "'); sys.__stdout__.flush()
        time.sleep(60)
    def huge(self):  # 20 MB through the pipe (the file-size rlimit does not bound a pipe)
        return "x" * (20 << 20)
'''


def _hostile_task(name):
    tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": {"type": "object", "properties": {}}}}
             for n in ("die", "hang", "env_key", "half_reply", "huge")]
    return Task(name, "envscaler", payload={"env_id": "h", "task": "x", "tools": tools, "intro": "", "class_name": "Hostile",
                                            "class_code": HOSTILE, "init_config": {}, "checks": []})


def test_process_faults_end_the_episode_with_a_reason(sandbox, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    # the 1 s limit only where the call must time out: a call that answers (or dies) gets 60 s,
    # so a loaded host cannot turn its verdict into a timeout
    env = EnvScalerEnvironment(sandbox, config=EpisodeConfig(call_timeout_s=60.0))
    hanging = EnvScalerEnvironment(sandbox, config=EpisodeConfig(call_timeout_s=1.0))
    obs, _, _ = _score(env, _hostile_task("k"), [ToolCall("env_key", {})])
    assert obs.messages[-1]["content"] == "absent"  # the class's process never sees our secrets
    for tool, reason, played in (("die", "envscaler_died", env), ("hang", "envscaler_timeout", hanging),
                                 ("half_reply", "envscaler_timeout", hanging),
                                 ("huge", "envscaler_malformed_reply", env)):
        with pytest.raises(EnvScalerFault) as err:
            _score(played, _hostile_task(tool), [ToolCall(tool, {})])
        assert err.value.end_reason == reason
        s = played.score()
        assert s["end_reason"] == reason and s["fault"] and s["reward"] == 0.0 and not s["success"]
    # a check that kills its process: the checks are judged one by one, the others still count
    from actionopd_jax.envs.envscaler.check import score_state
    from actionopd_jax.envs.envscaler.layout import EnvScalerScenario

    checks = [{"check_item": "ok", "check_func": "def check_func(final_state):\n    return final_state['n'] == 0\n"},
              {"check_item": "exits", "check_func": "def check_func(final_state):\n    import os\n    os._exit(1)\n"},
              {"check_item": "not bool", "check_func": "def check_func(final_state):\n    return 1\n"}]
    sc = EnvScalerScenario("c", "h", "Hostile", {}, "x", checks)
    out = score_state(sc, {"n": 0}, {"n": 0}, sandbox=sandbox)
    assert [r["passed"] for r in out.results] == [True, False, False] and out.reward == round(1 / 3, 4)
    assert "not a bool" in out.results[2]["error"] and out.results[1]["error"]
    bad = _hostile_task("bad")
    bad.payload["class_name"] = "Missing"
    with pytest.raises(EnvScalerFault, match="envscaler_start_failed"):
        run(env.reset(bad))


def _user_server(requests):
    """A scripted user behind our real OpenAI-compatible server: to the greeting it restates its
    goal (read from the system prompt), and it stops once the agent says the task is done."""
    def reply(req):
        requests.append(req.raw)
        last = req.messages[-1]["content"]
        if last == GREETING:
            return message_choice(req.messages[0]["content"].split("# Your goal\n", 1)[1])
        return message_choice(STOP if last == ENVSCALER_DONE else "Please go on.")

    return OpenAIServer(ScriptedBackend("scripted-user", reply))


def test_a_conversational_task_is_played_with_the_user_simulator_over_http(tasks, sandbox):
    t = tasks["mini_clinic_3"]
    assert t.payload["conversational"]
    requests: list = []
    with _user_server(requests) as server:
        sim = UserSimulator(UserSimConfig(base_url=server.base_url, model="scripted-user", temperature=1.0, max_tokens=None))
        env = EnvScalerEnvironment(sandbox, user_sim=sim)
        policy = reference_policy(t)

        async def episode():
            obs = await env.reset(t)
            done = obs.done
            while not done:
                obs, done = await env.step(policy.next_action(obs))
            return obs

        obs = run(episode())
    s = env.score()
    assert s["end_reason"] == "user_stop" and s["success"] and s["reward"] == 1.0 and s["tool_calls"] == 2
    # the user opened (its goal), the agent acted twice, said so, and the user stopped
    assert [m["role"] for m in obs.messages] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                 "assistant", "user"]
    assert obs.messages[1]["content"] == t.payload["task"] and obs.messages[-1]["content"] == STOP
    assert len(requests) == 2
    first, second = requests
    assert first["temperature"] == 1.0 and "max_tokens" not in first  # table 8: T=1, no response limit
    assert first["messages"][0]["role"] == "system" and t.payload["task"] in first["messages"][0]["content"]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][-1]["content"] == ENVSCALER_DONE  # the agent's text, seen as the user's input
    # without a simulator a conversational task is refused at reset, saying what to set
    with pytest.raises(ValueError, match="env.user_model"):
        run(EnvScalerEnvironment(sandbox).reset(t))


def test_reference_solutions_solve_every_mini_task(tasks, sandbox):
    env = EnvScalerEnvironment(sandbox)
    for t in tasks.values():
        if t.payload["conversational"]:
            continue
        policy = reference_policy(t)

        async def episode():
            obs = await env.reset(t)
            done = False
            while not done:
                obs, done = await env.step(policy.next_action(obs))

        run(episode())
        assert env.score()["success"], t.task_id


def test_tool_evidence_is_per_environment_with_the_method_source(tasks):
    from actionopd_jax.envs.evidence import evidence_scope
    from actionopd_jax.matching.build import tool_evidence_from

    evidence = tool_evidence_from(MatcherConfig(kind="rules+llm"), list(tasks.values()))
    assert sorted(evidence) == ["envscaler/env_1", "envscaler/env_2"]
    assert evidence_scope(tasks["mini_clinic_1"]) == "envscaler/env_2"
    text = evidence["envscaler/env_1"]["assign_parcel"]
    assert text.startswith("# EnvScaler tool ParcelLockerSystem.assign_parcel")
    assert '"locker_id"' in text and "def assign_parcel(self, parcel_id: str, locker_id: str)" in text
    assert "locker is occupied" in text and "def mark_collected" not in text  # this method only
    assert set(evidence["envscaler/env_2"]) == {"find_slots", "book_slot", "cancel_appointment", "list_appointments"}


def test_the_pool_factory_builds_envscaler_episodes_and_needs_a_user_for_conversational_tasks(tasks, tmp_path):
    from actionopd_jax.envs.registry import env_factory_from, pool_env_factory

    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"pools": {"envscaler": {"admitted": sorted(tasks)}}}))
    env = EnvConfig(name="envscaler", envscaler_dir=str(ES), manifest=str(manifest))
    with pytest.raises(ConfigError, match="conversational .*mini_clinic_3.*env.user_model"):
        env_factory_from(env)
    make = pool_env_factory(env, tasks=[t for t in tasks.values() if not t.payload["conversational"]])
    assert isinstance(make(tasks["mini_locker_1"]), EnvScalerEnvironment)
    with pytest.raises(ValueError, match="EnvScaler environment factory got a 'bfcl' task"):
        make(Task("x", "bfcl"))
    # a run's held-out tasks are never drawn by the mixture
    from actionopd_jax.envs.mixture import mixture_pool_tasks
    import dataclasses

    held = dataclasses.replace(env, heldout_task_ids=("mini_locker_2", "mini_clinic_2"))
    assert sorted(t.task_id for t in mixture_pool_tasks(held)["envscaler"]) == [
        "mini_clinic_1", "mini_clinic_3", "mini_locker_1", "mini_locker_3"]


class _MixtureSource:
    """The collector source's contract for the task stream (collect/source.py: each step draws
    `stream.next_step()`; state_dict / load_state_dict are the stream's state), with the
    synthetic source's groups standing in for collection so the test is about the stream."""

    def __init__(self, cfg, ctx, stream, drawn):
        from actionopd_jax.train.sources import synthetic_source

        self.inner, self.stream, self.drawn = synthetic_source(cfg, ctx), stream, drawn

    def collect(self, step, policy):
        self.drawn[step] = [t.task_id for t in self.stream.next_step()]
        return self.inner.collect(step, policy)

    def state_dict(self):
        return self.stream.get_state()

    def load_state_dict(self, state):
        self.stream.set_state(state)


def test_a_resumed_run_draws_the_same_mixture_tasks(tasks, tmp_path):
    """The stream state goes into the checkpoint: steps 0-1 drawn in one run equal step 0 of a run
    stopped after its first checkpoint plus step 1 drawn by a fresh trainer resuming it."""
    from actionopd_jax.config import Config
    from actionopd_jax.config.load import replace_keys
    from actionopd_jax.envs.mixture import mixture_stream_from
    from actionopd_jax.train.loop import Trainer

    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"pools": {"envscaler": {"admitted": sorted(tasks)}}}))
    env = EnvConfig(name="envscaler", envscaler_dir=str(ES), manifest=str(manifest), mixture=("envscaler:3",))
    cfg = replace_keys(Config(), **{"run.progress": False, "run.tensorboard": False, "checkpoint.async_save": False,
                                    "collect.synthetic.groups_per_step": 2, "checkpoint.every_steps": 1})

    def train(run_dir, steps, drawn, resume=None):
        c = replace_keys(cfg, **{"train.steps": steps})
        trainer = Trainer(c, run_dir=run_dir, resume=resume,
                          source=lambda ctx: _MixtureSource(c, ctx, mixture_stream_from(env, per_step=3, seed=5), drawn))
        try:
            assert trainer.run() == 0
        finally:
            trainer.close()

    whole, first, rest = {}, {}, {}
    train(tmp_path / "a", 2, whole)
    train(tmp_path / "b", 1, first)
    train(tmp_path / "b", 2, rest, resume="latest")
    assert sorted(whole) == [0, 1] and sorted(first) == [0] and sorted(rest) == [1]
    assert {**first, **rest} == whole
    assert whole[1] != whole[0]  # the draws move on: a stream restarted from scratch would repeat step 0


KILLED_TRAINER = """
import asyncio, sys, time
sys.path.insert(0, {root!r})
from actionopd_jax.envs.envscaler.env import EnvScalerEnvironment
from actionopd_jax.envs.envscaler.layout import load_envscaler
from actionopd_jax.envs.sandbox import SubprocessSandbox
from actionopd_jax.types import Task
FORKER = '''
import os, time
class Forker:
    def __init__(self, cfg=None):
        if os.fork() == 0:  # a grandchild that would outlive its group if nothing held it
            os.setsid(); time.sleep(600); os._exit(0)
    def ping(self):
        return "pong"
'''
base = next(t for t in load_envscaler({es!r}).tasks() if not t.payload.get("conversational"))
hostile = Task("forker", "envscaler", payload={{**base.payload, "class_code": FORKER, "class_name": "Forker",
                                                "init_config": {{}}}})
envs = [EnvScalerEnvironment(SubprocessSandbox()) for _ in range(3)]
async def main():  # the class processes start on the episodes' executor threads, as in training
    await asyncio.gather(envs[0].reset(base), envs[1].reset(base), envs[2].reset(hostile))
asyncio.run(main())
print("READY", flush=True)
time.sleep(600)
"""


def test_no_class_process_outlives_a_kill_9_of_the_trainer(tmp_path):
    """EnvScaler's class processes are spawned from executor threads (not the MCP pool's loop
    thread): after a `kill -9` of their trainer none remains, a forked, setsid()-escaped one
    included. The processes are found by the private directories TMPDIR puts under tmp_path."""
    import subprocess
    import sys

    from tests.test_env_mcp import marked_pids, wait_gone

    code = KILLED_TRAINER.format(root=str(Path(__file__).parents[1]), es=str(ES))
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(tmp_path)})
    mark = str(tmp_path)  # every sandboxed process's HOME / TMPDIR lies under it
    try:
        assert trainer.stdout.readline().strip() == "READY"
        contained = [p for p in marked_pids(mark) if p != trainer.pid]
        assert len(contained) >= 4, contained  # 3 class processes + the forked grandchild
        trainer.kill()
        trainer.wait(10)
        assert wait_gone(mark) == []
    finally:
        trainer.kill()
