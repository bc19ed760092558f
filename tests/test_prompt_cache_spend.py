"""Issue 35 item 1: the vendor's prompt cache. An agent's conversation grows by one turn per
decision, so most of each prompt is a prefix the vendor has seen and bills at its cached-input
rate (the price's middle number). The meters count those tokens from the reply's usage, in each
vendor's spelling, and price them at that rate; a vendor that says nothing is priced as uncached.

The replies come from our loopback server (real HTTP, the real `openai` client), answered by a
middleware that plays a vendor reporting cache use, as OpenAI / vLLM and DeepSeek spell it."""

import asyncio
import json

import pytest

from actionopd_jax.collect.spend import SpendMeter, SpendMeters
from actionopd_jax.envs import user_sim
from actionopd_jax.envs.user_sim import UserSimConfig, UserSimulator
from actionopd_jax.providers import cached_prompt_tokens
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.teacher.base import UsageReport
from actionopd_jax.train.spend_report import spend_table
from tests._teacher_fixtures import STATE, TOOLS, serve, teacher_for

OPENAI_USAGE = {"prompt_tokens": 1000, "completion_tokens": 50, "total_tokens": 1050,
                "prompt_tokens_details": {"cached_tokens": 800}}
DEEPSEEK_USAGE = {"prompt_tokens": 1000, "completion_tokens": 50, "total_tokens": 1050,
                  "prompt_cache_hit_tokens": 600, "prompt_cache_miss_tokens": 400}
PLAIN_USAGE = {"prompt_tokens": 1000, "completion_tokens": 50, "total_tokens": 1050}


def test_each_vendors_spelling_is_read_and_nonsense_counts_zero():
    assert cached_prompt_tokens(OPENAI_USAGE) == 800
    assert cached_prompt_tokens(DEEPSEEK_USAGE) == 600
    assert cached_prompt_tokens(PLAIN_USAGE) == 0
    assert cached_prompt_tokens(None) == 0
    assert cached_prompt_tokens({"prompt_tokens": 10, "prompt_tokens_details": None}) == 0
    assert cached_prompt_tokens({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": "9"}}) == 0
    assert cached_prompt_tokens({"prompt_tokens": 10, "prompt_cache_hit_tokens": -3}) == 0
    assert cached_prompt_tokens({"prompt_tokens": 10, "prompt_cache_hit_tokens": True}) == 0
    # never more than the prompt (a vendor's bad count would make spend negative)
    assert cached_prompt_tokens({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 50}}) == 10
    # the openai client's own usage object
    from openai.types import CompletionUsage

    assert cached_prompt_tokens(CompletionUsage.model_validate(OPENAI_USAGE)) == 800


def test_cached_input_is_priced_at_the_cached_rate_by_hand():
    """price [2, 0.5, 10] USD per million: 1,000 prompt tokens of which 800 cached, 200 out:
    (200 x 2 + 800 x 0.5 + 200 x 10) / 1e6 = $0.0028 (uncached it would be $0.004)."""
    meter = SpendMeter(price=(2.0, 0.5, 10.0))
    out = meter.add(UsageReport(http_calls=1, prompt_tokens=1000, cached_prompt_tokens=800, completion_tokens=200))
    assert out["teacher/spend_usd"] == pytest.approx(0.0028)
    assert out["teacher/cached_prompt_tokens_total"] == 800.0 and out["teacher/prompt_tokens_total"] == 1000.0
    # a count over the prompt is clamped to it: all input at the cached rate, never negative
    out = meter.add(UsageReport(prompt_tokens=100, cached_prompt_tokens=500))
    assert out["teacher/spend_usd"] == pytest.approx(100 * 0.5 / 1e6)
    # carried through the checkpoint's state, and older state (without the field) reads as 0
    restored = SpendMeters({"teacher": (2.0, 0.5, 10.0)})
    restored.load({"meter": meter.state()})
    assert restored.teacher.cached_prompt_tokens == 900
    older = {k: v for k, v in meter.state().items() if k != "cached_prompt_tokens"}
    fresh = SpendMeters({"teacher": (2.0, 0.5, 10.0)})
    fresh.load({"meter": older})
    assert fresh.teacher.cached_prompt_tokens == 0 and fresh.teacher.prompt_tokens == 1100


def _vendor(usages):
    """A middleware answering every chat request as a vendor would, with the next usage."""
    queue = list(usages)

    async def answer(body):
        usage = queue.pop(0)
        n = int(body.get("n") or 1)
        choice = {"message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
            "finish_reason": "tool_calls"}
        if not body.get("tools"):
            choice = {"message": {"role": "assistant", "content": "I would like to book a flight."},
                      "finish_reason": "stop"}
        return 200, {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                     "choices": [{"index": i, **choice} for i in range(n)], "usage": usage}, {}

    return answer, queue


def test_cache_use_reported_over_http_reaches_the_teacher_and_user_meters_and_the_table():
    middleware, left = _vendor([OPENAI_USAGE, DEEPSEEK_USAGE, PLAIN_USAGE, OPENAI_USAGE, DEEPSEEK_USAGE])
    with serve([ScriptedBackend("teacher", lambda req: message_choice("unused"))], middleware=middleware) as server:
        teacher = teacher_for(server)
        for _ in range(3):   # OpenAI's spelling, DeepSeek's, none
            samples = asyncio.run(teacher.sample(STATE, TOOLS, 2))
            assert len(samples) == 2
        assert (teacher.usage.http_calls, teacher.usage.prompt_tokens, teacher.usage.cached_prompt_tokens,
                teacher.usage.completion_tokens) == (3, 3000, 800 + 600, 150)

        before = user_sim.USAGE.snapshot()
        sim = UserSimulator(UserSimConfig(base_url=server.base_url, model="teacher", provider="vllm"))

        async def two_turns():
            try:
                for _ in range(2):
                    await sim.reply("You are a customer.", [{"role": "assistant", "content": "How can I help?"}])
            finally:
                await sim.aclose()

        asyncio.run(two_turns())
        after = user_sim.USAGE.snapshot()
        assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == 800 + 600
        assert after["prompt_tokens"] - before["prompt_tokens"] == 2000
    assert left == []

    # priced: teacher [2, 0.5, 10]: (1600 x 2 + 1400 x 0.5 + 150 x 10) / 1e6 = $0.0054
    meters = SpendMeters({"teacher": (2.0, 0.5, 10.0)})
    out = meters.add({"teacher": teacher.usage})
    assert out["teacher/spend_usd_total"] == pytest.approx(0.0054)
    history = [{"step": 0.0, **{k: v for k, v in out.items() if k.startswith("teacher/")}}]
    assert "| teacher | 3 | 0 | 3,000 (1,400 cached) | 150 | $0.0054 |" in spend_table(history)
