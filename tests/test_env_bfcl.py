"""BFCL multi-turn adapter: ground-truth replay scored by the package's official checker,
corrupted trajectories, strict (irrelevance) scoring, turn protocol, step limit, held-out
functions, isolation between concurrent episodes, and hostile tool calls."""

from __future__ import annotations

import ast
import asyncio
import collections
import json
import keyword
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from _envs_fixtures import run, run_reference

from actionopd_jax.envs import bfcl_data
from actionopd_jax.envs.bfcl import BFCLEnv
from actionopd_jax.envs.bfcl_exec import call_string, method_parameters, parse_call_string
from actionopd_jax.envs.reference import BFCL_CANNOT, BFCL_DONE, BFCLReference
from actionopd_jax.types import Invalid, Message, Task, ToolCall

TASKS = {t.task_id: t for t in bfcl_data.bfcl_tasks()}


def _task(task_id: str) -> Task:
    return TASKS[task_id]


async def _replay(task: Task, env: BFCLEnv | None = None, corrupt=None):
    env = env or BFCLEnv()
    obs, actions = await run_reference(env, task, corrupt=corrupt, max_decisions=2000)
    return env, obs, actions


def _gt_not_executable(task_id: str) -> str | None:
    """Ground truth our adapter cannot replay, by rule (not by outcome): a call to a function
    the turn does not offer yet, or a turn longer than BFCL's 20-step limit with one call per
    step."""
    entry = bfcl_data.load_entry(task_id)
    offered = {f["name"] for f in entry["function"]}
    names = method_parameters(entry["involved_classes"])
    for turn, calls in enumerate(bfcl_data.ground_truth(task_id)):
        offered |= {f["name"] for f in entry.get("missed_function", {}).get(str(turn), [])}
        if len(calls) > 20:
            return "more than 20 calls in a turn"
        for text in calls:
            if parse_call_string(text, names)[0] not in offered:
                return "calls a held-out function before its turn"
    return None


def test_replay_every_base_task_scores_100_percent_official_and_strict():
    async def main():
        failures = []
        for task_id in bfcl_data.task_ids(["base"]):
            env, obs, _ = await _replay(_task(task_id))
            score = env.score()
            if not (score["official"] == 1.0 and score["strict"] == 1.0 and score["end_reason"] == "completed"):
                failures.append((task_id, score))
        return failures

    failures = run(main())
    assert len(bfcl_data.task_ids(["base"])) == 200
    assert failures == []


def test_replay_other_categories_where_ground_truth_is_executable():
    async def main():
        outcome = collections.Counter()
        wrong = []
        for category in ("miss_func", "miss_param", "long_context"):
            for task_id in bfcl_data.task_ids([category]):
                why = _gt_not_executable(task_id)
                env, _, _ = await _replay(_task(task_id))
                score = env.score()
                outcome[category, why is None, score["official"]] += 1
                if why is None and (score["official"] != 1.0 or score["strict"] != 1.0):
                    wrong.append((task_id, score))
        return outcome, wrong

    outcome, wrong = run(main())
    assert wrong == []
    # Exactly three tasks are outside what one-call-per-step replay can do (listed in the notes).
    not_executable = sum(v for (cat, ok, _), v in outcome.items() if not ok)
    assert not_executable == 3
    assert sum(outcome.values()) == 600


def test_long_turn_hits_the_step_limit_and_fails_but_passes_with_a_larger_limit():
    task = _task("multi_turn_long_context_46")  # one turn of 34 ground-truth calls
    env, obs, actions = run(_replay(task))
    assert obs.info["end_reason"] == "step_limit"
    assert sum(isinstance(a, ToolCall) for a in actions) == 21  # the 21st step exceeds 20
    assert env.score()["official"] == 0.0
    env, obs, _ = run(_replay(task, env=BFCLEnv(max_steps_per_turn=40)))
    assert obs.info["end_reason"] == "completed"
    assert env.score()["official"] == 1.0


def _first_call_index(actions_by_turn):
    return next(i for i, a in enumerate(actions_by_turn) if isinstance(a, ToolCall))


@pytest.mark.parametrize("task_id", ["multi_turn_base_0", "multi_turn_base_17", "multi_turn_long_context_5"])
def test_corrupted_trajectories_fail(task_id):
    task = _task(task_id)
    gt_calls = [c for turn in bfcl_data.ground_truth(task_id) for c in turn]
    assert gt_calls

    def drop_last_call(obs, action):
        # Skip the final ground-truth call of the episode: answer instead of calling.
        ref_calls = sum(1 for m in obs.messages if m.get("tool_calls"))
        if isinstance(action, ToolCall) and ref_calls == len(gt_calls) - 1:
            return Message("Done.")
        return action

    changed = {"done": False}

    def change_an_argument(obs, action):
        # The first call of the episode with a string argument gets a different value.
        if isinstance(action, ToolCall) and not changed["done"]:
            args = dict(action.arguments)
            key = next((k for k, v in args.items() if isinstance(v, str)), None)
            if key is not None:
                changed["done"] = True
                args[key] = args[key] + "_x"
                return ToolCall(action.name, args)
        return action

    def end_first_turn_early(obs, action):
        users = sum(1 for m in obs.messages if m["role"] == "user")
        return Message("I will not do that.") if users == 1 else action

    for corrupt in (drop_last_call, change_an_argument, end_first_turn_early):
        env, _, _ = run(_replay(task, corrupt=corrupt))
        assert env.score()["official"] == 0.0, corrupt.__name__
    assert changed["done"]
    env, _, _ = run(_replay(task))
    assert env.score()["official"] == 1.0


def test_strict_score_applies_irrelevance_check_on_turns_whose_answer_is_no_call():
    task = _task("multi_turn_miss_param_0")
    gt = bfcl_data.ground_truth(task.task_id)
    assert [len(t) for t in gt] == [3, 2, 1, 0, 4]
    used = {"done": False}

    def call_on_the_empty_turn(obs, action):
        if isinstance(action, Message) and action.text == BFCL_CANNOT and not used["done"]:
            used["done"] = True
            return ToolCall("pwd", {})  # read-only: the state stays right, the call is still wrong
        return action

    env, _, _ = run(_replay(task, corrupt=call_on_the_empty_turn))
    score = env.score()
    assert used["done"] and score["official"] == 1.0 and score["strict"] == 0.0
    assert score["error_type"] == "multi_turn:irrelevance_error:decoder_success"


def test_turn_protocol_and_held_out_functions():
    task = _task("multi_turn_miss_func_0")
    entry = bfcl_data.load_entry(task.task_id)
    (turn_key, held_out), = entry["missed_function"].items()
    held_names = {f["name"] for f in held_out}

    async def main():
        env = BFCLEnv()
        ref = BFCLReference(task)
        obs = await env.reset(task)
        assert [m["role"] for m in obs.messages] == ["user"] and obs.info["turn"] == 0
        assert held_names.isdisjoint(t["function"]["name"] for t in obs.tools)
        # A held-out function is not callable before its turn (checked on a second episode).
        probe = BFCLEnv()
        await probe.reset(task)
        probe_obs, _ = await probe.step(ToolCall(sorted(held_names)[0], {}))
        assert "is not available here" in probe_obs.messages[-1]["content"]
        seen_turns = []
        done = False
        while not done:
            action = ref.next_action(obs)
            obs, done = await env.step(action)
            if isinstance(action, Message) and not done:
                seen_turns.append(obs.info["turn"])
                if obs.info["turn"] == int(turn_key):
                    assert held_names <= {t["function"]["name"] for t in obs.tools}
                    from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC

                    assert obs.messages[-1] == {"role": "user", "content": DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC}
                else:
                    assert obs.info["turn"] < int(turn_key) or held_names <= {t["function"]["name"] for t in obs.tools}
        assert seen_turns == list(range(1, len(entry["question"])))
        with pytest.raises(Exception, match="ended"):
            await env.step(Message("more"))
        return env.score()

    score = run(main())
    assert score["official"] == 1.0


def test_invalid_reply_ends_the_turn_like_an_undecodable_reply():
    async def main():
        env = BFCLEnv()
        obs = await env.reset(_task("multi_turn_base_0"))
        obs, done = await env.step(Invalid("two tool calls"))
        return obs, done

    obs, done = run(main())
    assert not done and obs.info["turn"] == 1 and obs.messages[1] == {"role": "assistant", "content": ""}


def test_concurrent_episodes_of_one_task_are_isolated():
    """Two episodes of a long-context travel task (whose classes link module-level objects
    into their state) stepped alternately, one corrupted, equal the episodes run alone."""
    task = _task("multi_turn_long_context_150")
    assert bfcl_data.load_entry(task.task_id)["involved_classes"] == ["TravelAPI"]

    def corrupt(obs, action):
        if isinstance(action, ToolCall):
            return ToolCall(action.name, {k: (v + "_x" if isinstance(v, str) else v) for k, v in action.arguments.items()})
        return action

    async def alone(c):
        env, obs, _ = await _replay(task, corrupt=c)
        return obs.messages, env.score()

    async def interleaved():
        envs = [BFCLEnv(), BFCLEnv()]
        refs = [BFCLReference(task), BFCLReference(task)]
        obs = [await envs[0].reset(task), await envs[1].reset(task)]
        done = [False, False]
        while not all(done):
            for i in (0, 1):
                if done[i]:
                    continue
                action = refs[i].next_action(obs[i])
                if i == 1:
                    action = corrupt(obs[i], action)
                obs[i], done[i] = await envs[i].step(action)
        scores = await asyncio.gather(asyncio.to_thread(envs[0].score), asyncio.to_thread(envs[1].score))
        return [(obs[i].messages, scores[i]) for i in (0, 1)]

    clean, dirty = run(alone(None)), run(alone(corrupt))
    both = run(interleaved())
    assert both[0] == clean and both[1] == dirty
    assert clean[1]["official"] == 1.0 and dirty[1]["official"] == 0.0
    # Scoring is repeatable: the checker's cached instances do not leak between calls.
    assert run(alone(None))[1] == clean[1]


def test_hostile_tool_calls_are_reported_never_executed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # if the payload ever ran, it would create ./pwned here
    marker = tmp_path / "pwned"
    payload = "__import__('os').system('touch pwned')"
    task = _task("multi_turn_base_0")  # GorillaFileSystem + TwitterAPI

    async def main():
        env = BFCLEnv()
        obs = await env.reset(task)
        fs = env._instances.instances["GorillaFileSystem"]
        before = json.dumps(repr(vars(fs)))
        hostile = [
            ToolCall("__init__", {}),
            ToolCall("_load_scenario", {"scenario": {}}),
            ToolCall("__class__", {}),
            ToolCall("eval", {"source": payload}),
            ToolCall("exec", {"source": payload}),
            ToolCall("os.system", {"command": "touch pwned"}),
            ToolCall("cd", {"folder": "x" * 40_000}),  # huge string
            ToolCall("cd", {"folder": "a", "__class__": 1}),  # dunder parameter name
            ToolCall("cd", {"folder": "a", "extra": 1}),  # unknown parameter
            ToolCall("cd", {}),  # missing parameter
            ToolCall("cd", {"folder": float("nan")}),
            ToolCall("cd", {"folder": 10**30}),
            ToolCall("cd", {"folder": object()}),
            ToolCall("mkdir", {"dir_name": [[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]}),
        ]
        for call in hostile:
            obs, done = await env.step(call)
            assert not done
            assert obs.messages[-1]["content"].startswith("Error during execution: "), call
        assert json.dumps(repr(vars(fs))) == before  # no state change
        # A hostile *string value* is just a string: it names a file and a tweet.
        for call in [ToolCall("touch", {"file_name": payload}), ToolCall("echo", {"content": payload, "file_name": payload})]:
            obs, _ = await env.step(call)
            assert not obs.messages[-1]["content"].startswith("Error"), obs.messages[-1]
        assert payload in fs._current_dir.contents
        while not done:  # finish every turn so the official checker re-executes the calls
            obs, done = await env.step(Message("ok"))
        return env.score()

    score = run(main())
    assert not marker.exists() and not os.path.exists("pwned")
    # The checker did run (it found a wrong state rather than a truncated run).
    assert score["official"] == 0.0 and score["error_type"] != "multi_turn:force_terminated", score


def test_strict_types_turn_wrong_types_into_tool_errors():
    task = _task("multi_turn_base_173")  # its ground truth passes a string to an 'integer' parameter

    async def main(env):
        obs = await env.reset(task)
        obs, _ = await env.step(ToolCall("close_ticket", {"ticket_id": "ticket_001"}))
        return obs.messages[-1]["content"], env._instances.instances["TicketAPI"].ticket_queue[0]["status"]

    text, status = run(main(BFCLEnv(strict_types=True)))
    assert text.startswith("Error during execution: arguments.ticket_id: expected integer") and status == "Open"
    text, status = run(main(BFCLEnv()))
    assert "closed successfully" in text and status == "Closed"


def test_call_strings_are_literals_and_ground_truth_parsing_never_evaluates():
    names = {"sort": ["file_name"], "cd": ["folder"]}
    assert parse_call_string("sort('final_report.pdf')", names) == ("sort", {"file_name": "final_report.pdf"})
    assert parse_call_string("cd(folder='a')", names) == ("cd", {"folder": "a"})
    assert parse_call_string("f(x=(1, 2))", {}) == ("f", {"x": [1, 2]})
    for bad in ["__import__('os').system('x')", "cd(folder=__import__('os'))", "os.system('x')", "cd(**{'a': 1})", "cd(folder=a)"]:
        with pytest.raises((ValueError, SyntaxError)):
            parse_call_string(bad, names)
    text = call_string("cd", {"folder": "'); import os; os.system('x'); ('"})
    assert text == "cd(folder=\"'); import os; os.system('x'); ('\")"
    for bad in [("__init__", {}), ("cd", {"__class__": 1}), ("cd", {"a": float("inf")}), ("cd", {"a": (1, 2)}), ("a.b", {})]:
        with pytest.raises(ValueError):
            call_string(*bad)


def test_reference_policy_closes_each_turn_with_a_message():
    task = _task("multi_turn_miss_param_2")  # first turn's answer is no call
    env, obs, actions = run(_replay(task))
    gt = bfcl_data.ground_truth(task.task_id)
    messages = [a for a in actions if isinstance(a, Message)]
    assert len(messages) == len(gt)
    assert [m.text for m in messages] == [BFCL_CANNOT if not t else BFCL_DONE for t in gt]
    assert sum(isinstance(a, ToolCall) for a in actions) == sum(len(t) for t in gt)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**62), 2**62) | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), json_values, max_size=4))
def test_call_string_is_one_call_of_literals_for_any_json_arguments(arguments):
    arguments = {k: v for k, v in arguments.items() if not keyword.iskeyword(k)}
    text = call_string("touch", arguments)
    tree = ast.parse(text, mode="eval").body
    assert isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and tree.func.id == "touch"
    assert not tree.args
    assert {kw.arg: ast.literal_eval(kw.value) for kw in tree.keywords} == arguments
