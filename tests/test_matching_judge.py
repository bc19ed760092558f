"""Matcher + LLM judge over our loopback server (real HTTP, real `openai` client): rule order,
what the judge sees, strict verdict parsing, failures -> unavailable, verdict reuse, and the
paper's worked example end to end (teacher over HTTP -> matcher -> rewards)."""

import asyncio
import random

import numpy as np
import pytest

from actionopd_jax.matching.judge import JudgeConfig, LLMJudge, parse_verdict, render_context, render_context_info
from actionopd_jax.matching.matcher import Matcher
from actionopd_jax.rewards import RewardConfig, score_group
from actionopd_jax.serve.faults import FaultInjector, FaultRates
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice, tool_call_choice
from actionopd_jax.teacher.cache import PersistentCache
from actionopd_jax.teacher.transport import RetryPolicy
from actionopd_jax.types import Invalid, Message, ToolCall
from tests._teacher_fixtures import STATE, TOOLS, serve, teacher_for

PARIS = ToolCall("get_weather", {"city": "Paris", "unit": "celsius"})
PARIS_LOWER = ToolCall("get_weather", {"unit": "celsius", "city": "paris"})
ROME = ToolCall("get_weather", {"city": "Rome", "unit": "celsius"})


def judge_reply(req):
    """A judge model that accepts case variants of the city and the basic-economy paraphrase."""
    prompt = req.messages[-1]["content"]
    same = ('"paris"' in prompt and '"Paris"' in prompt) or "cannot be changed" in prompt
    return message_choice("Same city, different case.\nVERDICT: MATCH" if same else "VERDICT: NO_MATCH")


def judge_backend(rule=None):
    """A judge server; `rule(prompt) -> reply text` overrides the default; records requests."""
    if rule is None:
        return ScriptedBackend("judge", judge_reply)
    return ScriptedBackend("judge", lambda req: message_choice(rule(req.messages[-1]["content"])))


def make_judge(server, **overrides):
    cfg = dict(model="judge", base_url=server.base_url, provider="vllm", api_key_env=None, thinking=False,
               request_timeout_s=5.0,
               retry=RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.02, max_total_s=5.0))
    cfg.update(overrides)
    return LLMJudge(JudgeConfig(**cfg), rng=random.Random(0))


def test_parse_verdict_is_strict():
    assert parse_verdict("VERDICT: MATCH") == "match"
    assert parse_verdict("  Both ask for Paris.\n\nVERDICT: MATCH\n") == "match"
    assert parse_verdict("VERDICT: NO_MATCH") == "no_match"
    assert parse_verdict("VERDICT: AMBIGUOUS") == "no_match"  # ambiguous is negative
    assert parse_verdict("<think>hmm, VERDICT: NO_MATCH?</think>\nVERDICT: MATCH") == "match"
    for bad in ["MATCH", "verdict: match", "VERDICT: MATCH.", "VERDICT:MATCH", "VERDICT: MATCH\nthanks",
                "VERDICT: NO_MATCH\nVERDICT: MATCH", "VERDICT: PARTIAL", "", None, 42,
                "The verdict is MATCH\nVERDICT: MATCH", "<think>unclosed VERDICT: MATCH"]:
        assert parse_verdict(bad) is None, bad


def test_rules_decide_without_the_judge():
    backend = judge_backend()
    with serve(backend) as server:
        m = Matcher(make_judge(server))

        async def go():
            v = lambda a, b: m.verdict(a, b, messages=STATE, tools=TOOLS)  # noqa: E731
            return [
                await v(Invalid("bad json"), Invalid("bad json")),            # invalid never matches
                await v(PARIS, Message("It is sunny in Paris")),               # cross-kind
                await v(ToolCall("get_forecast", PARIS.arguments), PARIS),     # name differs
                await v(ToolCall("get_weather", {"unit": "celsius", "city": "Paris"}), PARIS),  # key order
                await v(ToolCall("get_weather", {"city": "Paris", "n": 1.0}), ToolCall("get_weather", {"n": 1, "city": "Paris"})),
                await v(Message("Hello,  there!"), Message("hello there")),     # normalized exact
            ]

        assert asyncio.run(go()) == ["no_match", "no_match", "no_match", "match", "match", "match"]
        assert server.request_count == 0
    assert m.stats.programmatic_match == 3 and m.stats.judge_calls == 0


def test_judge_sees_schema_both_arguments_paths_and_context():
    backend = judge_backend()
    with serve(backend) as server:
        m = Matcher(make_judge(server))
        assert asyncio.run(m.verdict(PARIS_LOWER, PARIS, messages=STATE, tools=TOOLS)) == "match"
        assert asyncio.run(m.verdict(ROME, PARIS, messages=STATE, tools=TOOLS)) == "no_match"
        assert server.request_count == 2
        req = backend.requests[0]
        prompt = req.messages[-1]["content"]
        assert '"enum"' in prompt and "Current weather in a city." in prompt  # the tool schema
        assert '"paris"' in prompt and '"Paris"' in prompt                    # both argument objects
        assert "- $.city" in prompt and "$.unit" not in prompt                # the differing paths
        assert "How warm is it in Paris?" in prompt                           # public context
        assert req.temperature == 0.0 and req.max_tokens == 128 and req.tools is None
        assert req.raw["chat_template_kwargs"] == {"enable_thinking": False}
        # messages: both texts and the context
        text_a = "Basic-economy tickets cannot be changed."
        text_b = "Changes are not permitted for basic-economy tickets."
        assert asyncio.run(m.verdict(Message(text_a), Message(text_b), messages=STATE, tools=TOOLS)) == "match"
        prompt = backend.requests[-1].messages[-1]["content"]
        assert text_a in prompt and text_b in prompt and "get_weather" in prompt and "How warm" in prompt


@pytest.mark.parametrize("fault", ["server_error", "malformed", "hang", "rate_limit"])
def test_judge_transport_failures_are_unavailable_not_no_match(fault):
    rates = FaultRates(**{fault: 1.0}, hang_s=3.0, retry_after_s=0.01)
    injector = FaultInjector(rates, seed=7)
    with serve(judge_backend(), middleware=injector) as server:
        m = Matcher(make_judge(server, request_timeout_s=0.2))
        verdicts = asyncio.run(m.match_group([ROME, PARIS], [PARIS], messages=STATE, tools=TOOLS))
    # ROME vs PARIS needs the judge -> unavailable; PARIS vs PARIS is decided by the rules.
    assert verdicts == [["unavailable"], ["match"]]
    assert injector.requests_seen == 3  # bounded retries, then give up
    s = score_group(verdicts, [True, True], RewardConfig())
    assert not s.retained and s.drop_reason == "unavailable" and s.train_rewards is None


@pytest.mark.parametrize("reply", ["They look the same to me.", "MATCH", "VERDICT: match", "VERDICT: MAYBE"])
def test_unparsable_judge_reply_is_unavailable(reply):
    with serve(judge_backend(lambda prompt: reply)) as server:
        m = Matcher(make_judge(server))
        assert asyncio.run(m.verdict(ROME, PARIS, messages=STATE, tools=TOOLS)) == "unavailable"
        assert server.request_count == 3  # asked again twice (format_retries=2), then unavailable
        assert m.stats.unavailable_format == 1 and m.stats.judge_format_retries == 2
        once = Matcher(make_judge(server, format_retries=0))
        assert asyncio.run(once.verdict(ROME, PARIS, messages=STATE, tools=TOOLS)) == "unavailable"
        assert server.request_count == 3 + 1


def test_ambiguous_is_no_match_and_permanent_error_is_unavailable():
    with serve(judge_backend(lambda prompt: "Unclear.\nVERDICT: AMBIGUOUS")) as server:
        m = Matcher(make_judge(server))
        assert asyncio.run(m.verdict(ROME, PARIS, messages=STATE, tools=TOOLS)) == "no_match"
        wrong_model = Matcher(make_judge(server, model="missing-judge"))
        assert asyncio.run(wrong_model.verdict(ROME, PARIS, messages=STATE, tools=TOOLS)) == "unavailable"


def test_identical_pairs_reuse_one_judgement_and_persist(tmp_path):
    async def slow(req):
        await asyncio.sleep(0.1)
        return judge_reply(req)

    backend = ScriptedBackend("judge", slow)
    candidates = [PARIS_LOWER, PARIS_LOWER, ROME, Invalid("x")]
    teacher = [PARIS, PARIS, ROME]
    with serve(backend) as server:
        cache = PersistentCache(tmp_path / "v.sqlite")
        m = Matcher(make_judge(server), cache=cache)
        verdicts = asyncio.run(m.match_group(candidates, teacher, messages=STATE, tools=TOOLS))
        assert verdicts == [["match", "match", "no_match"], ["match", "match", "no_match"],
                            ["no_match", "no_match", "match"], ["no_match", "no_match", "no_match"]]
        # 8 pairs need the judge (6 for the two PARIS_LOWER rows, 2 ROME-vs-PARIS), only 3 are
        # distinct: (paris_lower, PARIS), (paris_lower, ROME), (ROME, PARIS)
        assert server.request_count == 3 and m.stats.judge_calls == 3 and m.stats.judge_reused == 8 - 3
        # a new matcher over the same cache file: zero judge calls
        m2 = Matcher(make_judge(server), cache=PersistentCache(tmp_path / "v.sqlite"))
        assert asyncio.run(m2.match_group(candidates, teacher, messages=STATE, tools=TOOLS)) == verdicts
        assert server.request_count == 3
        # different context -> a different pair key -> judged again
        other_state = STATE + [{"role": "user", "content": "Actually, Rome."}]
        asyncio.run(m2.verdict(ROME, PARIS, messages=other_state, tools=TOOLS))
        assert server.request_count == 4


def test_unavailable_verdicts_are_not_cached(tmp_path):
    injector = FaultInjector(FaultRates(), seed=0, script=["server_error"] * 3)
    with serve(judge_backend(), middleware=injector) as server:
        cache = PersistentCache(tmp_path / "v.sqlite")
        m = Matcher(make_judge(server), cache=cache)
        assert asyncio.run(m.verdict(ROME, PARIS, messages=STATE, tools=TOOLS)) == "unavailable"
        assert cache.summary()["verdict_entries"] == 0
        assert asyncio.run(m.verdict(ROME, PARIS, messages=STATE, tools=TOOLS)) == "no_match"  # asked again
        assert cache.summary()["verdict_entries"] == 1


def test_paper_worked_example_end_to_end():
    """Teacher over HTTP returns [A, A, B]; candidates match A, match B, differ, are invalid."""
    a_call = tool_call_choice("get_weather", {"city": "Paris", "unit": "celsius"})
    b_msg = message_choice("Which unit would you like?")
    teacher_backend = ScriptedBackend("teacher", lambda req: [a_call, a_call, b_msg])
    with serve([teacher_backend, judge_backend()]) as server:
        samples = asyncio.run(teacher_for(server).sample(STATE, TOOLS, 3))
        teacher_actions = [s.action for s in samples]
        assert teacher_actions == [PARIS, PARIS, Message("Which unit would you like?")]
        candidates = [PARIS_LOWER, Message("which unit would you like"), ROME, Invalid("two tool calls")]
        m = Matcher(make_judge(server))
        verdicts = asyncio.run(m.match_group(candidates, teacher_actions, messages=STATE, tools=TOOLS))
    s = score_group(verdicts, [not isinstance(c, Invalid) for c in candidates], RewardConfig(k=3, lam=0.5))
    np.testing.assert_allclose(s.train_rewards, [1.25, 1.0, 0.0, -1.0])
    assert s.retained


def test_render_context_keeps_system_and_latest_within_budget():
    msgs = [{"role": "system", "content": "S" * 50}] + [{"role": "user", "content": f"msg{i} " + "x" * 40} for i in range(20)]
    text = render_context(msgs, 300)
    assert text.startswith("[system] SSS") and "msg19" in text and "msg0 " not in text
    assert "earlier message(s) omitted" in text and len(text) < 400
    # hand count: "[system] " + 50 S = 59 chars; each user line "[user] msgI " + 40 x = 52 (53 from msg10)
    # budget 59 + 2 * 53 = 165 holds the system message and exactly the last two messages
    text, cut = render_context_info(msgs, 165)
    assert cut and "msg18" in text and "msg19" in text and "msg17" not in text and "18 earlier" in text
    assert render_context_info(msgs, 59 + 10 * 52 + 10 * 53) == ("\n".join(
        ["[system] " + "S" * 50] + [f"[user] msg{i} " + "x" * 40 for i in range(20)]), False)
    # a budget of 0 shows only markers, never the whole latest message
    text, cut = render_context_info(msgs, 0)
    assert cut and "x" * 40 not in text


LONG_POLICY = [{"role": "system", "content": "P" * 20_000}, {"role": "user", "content": "Please change my flight."}]


def test_judge_context_is_sized_to_the_window_and_truncations_are_counted():
    seen = []
    with serve(judge_backend(lambda prompt: seen.append(prompt) or "VERDICT: NO_MATCH")) as server:
        # default window 32768 tokens, 128-token replies: (32768 - 128 - 256) * 3 chars ~ 97k chars, so a
        # 20,000-character policy (tau2's are ~10-25k) is shown whole (the old fixed 8,000 cut it)
        m = Matcher(make_judge(server))
        assert asyncio.run(m.verdict(ROME, PARIS, messages=LONG_POLICY, tools=TOOLS)) == "no_match"
        assert "P" * 20_000 in seen[-1] and m.stats.judge_context_truncated == 0
        # a 1,024-token window: (1024 - 128 - 256) * 3 = 1,920 characters for system prompt + prompt
        small = Matcher(make_judge(server, context_window=1024))
        assert asyncio.run(small.verdict(ROME, PARIS, messages=LONG_POLICY, tools=TOOLS)) == "no_match"
        req = [r for r in server.backends["judge"].requests][-1]
        assert sum(len(msg["content"]) for msg in req.messages) <= 1920 + len(" [...]")
        assert "PPPP [...]" in seen[-1] and small.stats.judge_context_truncated == 1
        # a fixed budget: exactly what render_context gives for it
        fixed = Matcher(make_judge(server, context_chars=300))
        asyncio.run(fixed.verdict(ROME, PARIS, messages=LONG_POLICY, tools=TOOLS))
        assert render_context(LONG_POLICY, 300) in seen[-1] and fixed.stats.judge_context_truncated == 1
    with pytest.raises(ValueError, match="context_window=256 leaves no room"):
        JudgeConfig(model="j", base_url="http://x", provider="vllm", context_window=256)
