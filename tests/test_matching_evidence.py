"""Tool-implementation evidence for the judge (paper A.3): read from the installed BFCL and
tau2 packages, shown to the judge (real HTTP judge on 127.0.0.1), required where the
environment supplies it -- a judged pair without it is `unavailable` and no judge call is
made -- and wired from `matcher.tool_evidence` by the collector's source."""

import asyncio

from actionopd_jax.matching.build import tool_evidence_from
from actionopd_jax.config.load import load_config, replace_keys
from actionopd_jax.envs.evidence import tool_evidence
from actionopd_jax.envs.tau2_tasks import DOMAINS, environment_constructor
from actionopd_jax.matching.matcher import Matcher
from actionopd_jax.types import Task, ToolCall
from tests._teacher_fixtures import STATE, TOOLS, serve
from tests.test_matching_judge import PARIS, PARIS_LOWER, ROME, judge_backend, make_judge

EVIDENCE = "def get_weather(city: str, unit: str = 'celsius'):\n    city = city.lower()  # case-insensitive lookup"


def test_judged_pair_without_required_evidence_is_unavailable():
    backend = judge_backend()
    with serve(backend) as server:
        m = Matcher(make_judge(server), evidence_by_env={"weather": {"other_tool": "def other_tool(): ..."}})
        # same tool, different arguments: needs the judge, but the environment has no evidence for it
        got = asyncio.run(m.match_group([ROME, PARIS_LOWER, PARIS], [PARIS], messages=STATE, tools=TOOLS,
                                        env="weather"))
        assert got == [["unavailable"], ["unavailable"], ["match"]]  # equal arguments need no judge
        assert server.request_count == 0
        assert m.stats.missing_evidence == 2 and m.stats.unavailable == 2 and m.stats.judge_calls == 0
        # with the evidence the judge is asked, and sees it
        m.evidence_by_env["weather"]["get_weather"] = EVIDENCE
        assert asyncio.run(m.verdict(PARIS_LOWER, PARIS, messages=STATE, tools=TOOLS, env="weather")) == "match"
        assert server.request_count == 1
        prompt = backend.requests[-1].messages[-1]["content"]
        assert "Tool implementation evidence" in prompt and "case-insensitive lookup" in prompt
        # an environment that supplies no evidence does not require it
        assert asyncio.run(m.verdict(ROME, PARIS, messages=STATE, tools=TOOLS, env="toy")) == "no_match"
        assert server.request_count == 2 and "Tool implementation evidence" not in backend.requests[-1].messages[-1]["content"]


def test_evidence_is_part_of_the_verdict_key():
    m = Matcher(None, evidence_by_env={"weather": {"get_weather": EVIDENCE}})
    assert m.pair_key(ROME, PARIS, STATE, TOOLS, EVIDENCE) != m.pair_key(ROME, PARIS, STATE, TOOLS, None)


def test_evidence_covers_every_bfcl_and_tau2_tool():
    from actionopd_jax.envs.bfcl_data import CATEGORIES, _entries

    bfcl = tool_evidence("bfcl")
    names = {f["name"] for cat in CATEGORIES for e in _entries(cat).values() for f in e["function"]}
    assert names <= set(bfcl)
    assert "def get_stock_info(self, symbol" in bfcl["get_stock_info"] and "TradingBot.get_stock_info" in bfcl["get_stock_info"]
    for domain in DOMAINS:
        ev = tool_evidence(f"tau2_{domain}")
        assert set(environment_constructor(domain)().tools.get_tools()) == set(ev), domain
    assert "def book_reservation(" in tool_evidence("tau2_airline")["book_reservation"]
    assert tool_evidence("toy") is None


def test_config_switch_wires_evidence_per_environment():
    tasks = [Task("multi_turn_base_0", "bfcl", "test", {}), Task("airline/0", "tau2_airline", "train", {}),
             Task("t", "toy", "train", {})]
    cfg = load_config(None, ["matcher.kind=rules+llm"])
    assert cfg.matcher.tool_evidence  # on by default: the paper's rule
    wired = tool_evidence_from(cfg.matcher, tasks)
    assert set(wired) == {"bfcl", "tau2_airline"} and "get_stock_info" in wired["bfcl"]
    assert tool_evidence_from(replace_keys(cfg, **{"matcher.tool_evidence": False}).matcher, tasks) is None
    assert tool_evidence_from(replace_keys(cfg, **{"matcher.kind": "rules"}).matcher, tasks) is None
