"""The matcher's execution stage on BFCL episodes (issue 45): forks are deep copies of the
episode's real bfcl_eval class instances (envs/bfcl_fork.py); a BFCL multi-turn task from the
package's own data, its state reached by a real episode step."""

from __future__ import annotations

import asyncio

import pytest

from actionopd_jax.envs.bfcl import BFCLEnv
from actionopd_jax.envs.bfcl_exec import BFCLInstances
from actionopd_jax.envs.bfcl_fork import InstanceForkPoint, bfcl_effects, snapshot
from actionopd_jax.envs.fork import ToolEffects
from actionopd_jax.matching.execution import ExecutionStage, _values_at, call_key, effect
from actionopd_jax.matching.matcher import Matcher
from actionopd_jax.types import ToolCall as T
from test_env_bfcl import _task

PAIRS = [  # (student, teacher, what execution must say: match / no_match / None for the judge)
    (T("ls", {}), T("ls", {"a": False}), "match"),                                  # default written out
    (T("wc", {"file_name": "final_report.pdf", "mode": "l"}), T("wc", {"file_name": "final_report.pdf"}), "match"),
    (T("mkdir", {"dir_name": "temp"}), T("mkdir", {"dir_name": "tmp"}), "no_match"),  # one argument off
    (T("cat", {"file_name": "final_report.pdf"}), T("cat", {"file_name": "previous_report.pdf"}), "no_match"),
    (T("cat", {"file_name": "final_report.pdf"}), T("cat", {"file_name": "./final_report.pdf"}), None),  # fails
    (T("post_tweet", {"content": "hi"}), T("post_tweet", {"content": "hi", "tags": []}), None),  # not logged in
    # a file's modification time (datetime.now()) is declared volatile: a new file's stamp is
    # masked, so these decide (they abstained while the clock made every run differ)
    (T("touch", {"file_name": "a.txt"}), T("touch", {"file_name": "b.txt"}), "no_match"),
    (T("echo", {"content": "Q3", "file_name": "final_report.pdf"}),
     T("echo", {"content": "Q4", "file_name": "final_report.pdf"}), "no_match"),
    (T("echo", {"content": "hi"}), T("echo", {"content": "hi", "file_name": ""}), "match"),  # both to the terminal
    (T("echo", {"content": "hi", "file_name": "nope.txt"}), T("echo", {"content": "hi", "file_name": "no.txt"}), None),
]


def test_bfcl_pairs_are_decided_on_deep_copied_instances_and_the_episode_is_untouched():
    async def go():
        env = BFCLEnv()
        await env.reset(_task("multi_turn_base_0"))
        await env.step(T("cd", {"folder": "document"}))
        point = await env.fork_point()
        record = await ExecutionStage().decide(point, [(s, t) for s, t, _ in PAIRS])
        touch = T("touch", {"file_name": "a.txt"})
        twice = [await point.run(touch), await point.run(touch)]
        live = snapshot(env._instances.instances)
        obs, _ = await env.step(T("ls", {}))
        return point, live, obs, record, twice

    point, live, obs, record, twice = asyncio.run(go())
    got = [record.verdicts.get((call_key(s), call_key(t))) for s, t, _ in PAIRS]
    assert got == [want for _, _, want in PAIRS], record.abstained
    assert live == point.before  # nothing a fork did reached the live instances
    assert "temp" not in obs.messages[-1]["content"] and "a.txt" not in obs.messages[-1]["content"]
    # the new file's stamp is the only volatile value: masked, two runs are one effect; the
    # files that were there keep their stamps, compared as they are
    volatile = point.effects("touch").volatile
    assert volatile == ("_last_modified",) and not point.effects("cd").external
    stamps = [_values_at(r.state, frozenset(volatile), set()) - _values_at(point.before, frozenset(volatile), set())
              for r in twice]
    assert [len(fresh) for fresh in stamps] == [1, 1] and all(f.startswith("<datetime>") for f in stamps[0])
    assert effect(twice[0], point.before, volatile) == effect(twice[1], point.before, volatile)
    assert "failed" in record.abstained[(call_key(PAIRS[-1][0]), call_key(PAIRS[-1][1]))]


class WebSearchAPI:
    """A stand-in named as bfcl_eval's web search class (whose module needs html2text, which the
    install does not bring): its tools fetch live pages, so the stage must never run them."""

    def search_engine_query(self, keywords):
        raise AssertionError("a fork ran an external tool")


def test_external_bfcl_tools_are_never_run_on_a_fork():
    instances = BFCLInstances(["MathAPI"], {}, long_context=False)  # the real class for the pure tools
    instances.methods["search_engine_query"] = WebSearchAPI()
    effects = bfcl_effects(instances)
    assert effects("search_engine_query").external
    assert effects("mean") == ToolEffects()  # a pure function: decided as usual
    point = InstanceForkPoint(instances, lambda call: None, effects)
    ran = []
    point.run = lambda call: ran.append(call)  # noqa: E731 - the stage must not even ask
    pair = (T("search_engine_query", {"keywords": "a"}), T("search_engine_query", {"keywords": "A"}))
    record = asyncio.run(ExecutionStage().decide(point, [pair]))
    assert ran == [] and record.verdicts == {}
    assert "external" in record.abstained[(call_key(pair[0]), call_key(pair[1]))]


def test_the_collector_path_gives_bfcl_forks_to_the_matcher():
    m = Matcher(None, execution=ExecutionStage())

    async def go():
        env = BFCLEnv()
        obs = await env.reset(_task("multi_turn_base_0"))
        return await m.match_group([T("ls", {"a": False})], [T("ls", {})], messages=obs.messages, tools=obs.tools,
                                   env="bfcl", fork=env.fork_point)

    assert asyncio.run(go()) == [["match"]]  # rules only: without execution this pair would be no_match
    assert m.stats.execution_match == 1 and m.stats.rules_only_no_match == 0


def test_snapshot_sees_sets_tuples_back_references_and_random_state():
    import random

    class Node:
        def __init__(self, parent=None):
            self.parent, self.children = parent, []

    root = Node()
    root.children.append(Node(root))
    snap = snapshot(root)
    assert snap["attrs"]["children"][0]["attrs"]["parent"] == {"<back-reference>": "Node"}
    assert snapshot({1, 2}) == snapshot({2, 1}) and snapshot((1,)) != snapshot([1])
    a, b = random.Random(1), random.Random(1)
    b.random()
    assert snapshot(a) != snapshot(b)
    with pytest.raises(ValueError, match="too deep"):
        deep = []
        for _ in range(100):
            deep = [deep]
        snapshot(deep)

