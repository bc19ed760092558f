"""OpenAI-compatible teacher against our loopback server (real HTTP, real `openai` client),
with faults injected by the server middleware: retries, give-up, regeneration, secrets."""

import asyncio
import logging
import time

import pytest

from actionopd_jax.serve.faults import FaultInjector, FaultRates
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice, tool_call_choice
from actionopd_jax.teacher.openai_provider import OpenAITeacher, OpenAITeacherConfig
from actionopd_jax.teacher.transport import PermanentRequestError, RetryPolicy
from actionopd_jax.types import Message, ToolCall
from tests._teacher_fixtures import STATE, TOOLS, serve, teacher_for


def paris_call(req):
    return tool_call_choice("get_weather", {"city": "Paris", "unit": "celsius"})


def run(coro):
    return asyncio.run(coro)


def test_request_kwargs_provider_table():
    base = dict(model="m", base_url="http://127.0.0.1:1/v1", api_key_env=None, thinking=False, top_k=20)
    vllm = OpenAITeacher(OpenAITeacherConfig(provider="vllm", **base)).request_kwargs(STATE, TOOLS, 3)
    assert vllm["n"] == 3 and vllm["tools"] == TOOLS and vllm["temperature"] == 0.6 and vllm["top_p"] == 0.95
    assert vllm["extra_body"] == {"top_k": 20, "chat_template_kwargs": {"enable_thinking": False}}
    ds = OpenAITeacher(OpenAITeacherConfig(provider="deepseek", **{**base, "thinking": True, "top_k": None})
                       ).request_kwargs(STATE, TOOLS, 1)
    assert "n" not in ds and ds["extra_body"] == {"thinking": {"type": "enabled"}}
    dash = OpenAITeacher(OpenAITeacherConfig(provider="dashscope", **base)).request_kwargs(STATE, [], 1)
    assert dash["extra_body"] == {"top_k": 20, "enable_thinking": False} and "tools" not in dash
    orr = OpenAITeacher(OpenAITeacherConfig(provider="openrouter", **base)).request_kwargs(STATE, TOOLS, 1)
    assert orr["extra_body"]["reasoning"] == {"enabled": False}
    oa = OpenAITeacher(OpenAITeacherConfig(provider="openai", reasoning_effort="low",
                                           **{**base, "thinking": None, "top_k": None})).request_kwargs(STATE, TOOLS, 2)
    assert oa["reasoning_effort"] == "low" and "extra_body" not in oa
    with pytest.raises(ValueError, match="unknown provider"):
        OpenAITeacherConfig(provider="nope", model="m", base_url="http://x")
    # a setting the provider has no field for is refused, never dropped
    with pytest.raises(ValueError, match=r"teacher.top_k=20 cannot be sent to provider 'deepseek'.*vllm"):
        OpenAITeacherConfig(provider="deepseek", **base)
    with pytest.raises(ValueError, match=r"teacher.thinking=False cannot be sent to provider 'openai'.*deepseek"):
        OpenAITeacherConfig(provider="openai", **{**base, "top_k": None})


def test_k_samples_in_one_request_with_n_and_separately_without():
    backend = ScriptedBackend("teacher", paris_call)
    with serve(backend) as server:
        teacher = teacher_for(server)
        samples = run(teacher.sample(STATE, TOOLS, 3))
        assert [s.action for s in samples] == [ToolCall("get_weather", {"city": "Paris", "unit": "celsius"})] * 3
        assert server.request_count == 1 and backend.requests[0].n == 3
        assert backend.requests[0].tools == TOOLS and backend.requests[0].messages == STATE
        assert samples[0].text.startswith("<tool_call>") and "Paris" in samples[0].text
        assert teacher.usage.http_calls == 1 and teacher.usage.prompt_tokens > 0
        ds = teacher_for(server, provider="deepseek")
        run(ds.sample(STATE, TOOLS, 3))
        assert server.request_count == 1 + 3 and all(r.n == 1 for r in backend.requests[1:])


def test_transient_faults_are_retried_and_retry_after_honoured():
    injector = FaultInjector(FaultRates(retry_after_s=0.3), seed=1,
                             script=["rate_limit", "server_error", "malformed", "ok"])
    backend = ScriptedBackend("teacher", lambda r: message_choice("It is 21 degrees in Paris."))
    with serve(backend, middleware=injector) as server:
        teacher = teacher_for(server)
        t0 = time.monotonic()
        samples = run(teacher.sample(STATE, TOOLS, 1))
        elapsed = time.monotonic() - t0
    assert [s.action for s in samples] == [Message("It is 21 degrees in Paris.")]
    assert injector.requests_seen == 4 and teacher.usage.http_calls == 4 and teacher.usage.transport_retries == 3
    assert elapsed >= 0.3  # the 429's Retry-After (0.3 s) was waited, although backoff is only ~0.01 s


def test_hang_times_out_and_is_retried():
    # the hang (30 s) is 100x the request timeout: "did not wait for it" holds on any load
    injector = FaultInjector(FaultRates(hang_s=30.0), seed=2, script=["hang", "ok"])
    backend = ScriptedBackend("teacher", paris_call)
    with serve(backend, middleware=injector) as server:
        teacher = teacher_for(server, request_timeout_s=0.3)
        t0 = time.monotonic()
        samples = run(teacher.sample(STATE, TOOLS, 1))
        assert time.monotonic() - t0 < 15.0  # did not wait for the hang to end
    assert len(samples) == 1 and teacher.usage.transport_retries == 1


def test_gives_up_cleanly_within_bounds():
    # Every request fails with 500: 3 attempts per request, then the slot is lost (no exception).
    injector = FaultInjector(FaultRates(server_error=1.0), seed=3)
    backend = ScriptedBackend("teacher", paris_call)
    with serve(backend, middleware=injector) as server:
        teacher = teacher_for(server, retry=RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.02))
        batch = run(teacher.sample_detailed(STATE, TOOLS, 2))
        assert batch.samples == [] and batch.transport_failures == 2 and not batch.cacheable
        assert injector.requests_seen == 3  # one n=2 request, 3 attempts; no regeneration of lost slots
        # total-time bound: a server that always hangs is abandoned after max_total_s
        # (the hang, 30 s, and the request timeout, 20 s, are far beyond the 0.6 s budget: only the
        # budget can end the call before 15 s, on any load)
        hang = FaultInjector(FaultRates(hang=1.0, hang_s=30.0), seed=4)
        server.middleware = hang
        teacher2 = teacher_for(server, request_timeout_s=20.0,
                               retry=RetryPolicy(max_attempts=100, base_delay_s=0.01, max_total_s=0.6))
        t0 = time.monotonic()
        assert run(teacher2.sample(STATE, TOOLS, 1)) == []
        assert time.monotonic() - t0 < 15.0


def test_invalid_tool_calls_regenerate_at_most_twice():
    injector = FaultInjector(FaultRates(invalid_tool_call=1.0), seed=5)
    backend = ScriptedBackend("teacher", paris_call)
    with serve(backend, middleware=injector) as server:
        teacher = teacher_for(server, provider="deepseek")  # one request per reply: easy to count
        batch = run(teacher.sample_detailed(STATE, TOOLS, 3))
        assert batch.samples == [] and batch.cacheable  # no supervision, and it is the teacher's answer
        assert injector.requests_seen == 3 * 3  # 3 slots x (1 + 2 regenerations)
        assert batch.regenerations == 6 and batch.invalid_replies == 9
        # invalid first, then valid: the slot is filled by its first regeneration
        server.middleware = FaultInjector(FaultRates(), seed=6, script=["invalid_tool_call", "ok", "ok"])
        batch2 = run(teacher.sample_detailed(STATE, TOOLS, 2))
        assert len(batch2.samples) == 2 and batch2.regenerations == 1


def test_empty_choices_are_retried_and_bad_args_regenerated_and_both_counted():
    # an empty `choices` list is no reply (a transport retry); unparsable tool-call arguments
    # are an invalid reply (a regeneration): the slot is filled by the third request
    injector = FaultInjector(FaultRates(), seed=12, script=["empty_choices", "bad_args", "ok"])
    backend = ScriptedBackend("teacher", paris_call)
    with serve(backend, middleware=injector) as server:
        teacher = teacher_for(server, provider="deepseek")  # one request per reply: easy to count
        batch = run(teacher.sample_detailed(STATE, TOOLS, 1))
        assert [s.action for s in batch.samples] == [ToolCall("get_weather", {"city": "Paris", "unit": "celsius"})]
        assert dict(injector.injected) == {"empty_choices": 1, "bad_args": 1, "ok": 1}
        assert injector.requests_seen == 3 and len(backend.requests) == 1
        assert teacher.usage.transport_retries == 1  # the empty one
        assert batch.invalid_replies == 1 and batch.regenerations == 1  # the bad arguments
        assert batch.transport_failures == 0 and batch.cacheable


def test_a_reply_cut_mid_body_is_retried_and_counted():
    # headers promise a whole completion, half arrives, the connection drops: a transport
    # failure the client retries (issue 34: "reset mid-body"), not a reply
    injector = FaultInjector(FaultRates(), seed=3, script=["reset_mid_body", "ok"])
    backend = ScriptedBackend("teacher", paris_call)
    with serve(backend, middleware=injector) as server:
        teacher = teacher_for(server, provider="deepseek")
        batch = run(teacher.sample_detailed(STATE, TOOLS, 1))
    assert [s.action for s in batch.samples] == [ToolCall("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert dict(injector.injected) == {"reset_mid_body": 1, "ok": 1} and len(backend.requests) == 1
    assert teacher.usage.transport_retries == 1 and batch.transport_failures == 0 and batch.cacheable


def test_partial_multiset_and_valid_samples_never_regenerated():
    # n=3 request returns [valid, invalid, valid]; only the middle slot is asked again.
    calls = {"n": 0}

    def reply(req):
        calls["n"] += 1
        if calls["n"] == 1:
            bad = tool_call_choice("get_weather", {"city": 5})  # schema violation
            return [paris_call(req), bad, message_choice("Let me check.")]
        return [tool_call_choice("unknown_tool", {})] * req.n

    backend = ScriptedBackend("teacher", reply)
    with serve(backend) as server:
        batch = run(teacher_for(server).sample_detailed(STATE, TOOLS, 3))
    assert [type(s.action).__name__ for s in batch.samples] == ["ToolCall", "Message"]
    assert [r.n for r in backend.requests] == [3, 1, 1]


def test_permanent_error_is_raised_at_once_with_clear_message():
    backend = ScriptedBackend("teacher", paris_call)
    with serve(backend) as server:
        teacher = teacher_for(server, model="no-such-model")
        with pytest.raises(PermanentRequestError, match="404.*not found"):
            run(teacher.sample(STATE, TOOLS, 1))
        assert teacher.usage.http_calls == 1


def test_api_key_from_env_never_leaks(monkeypatch, caplog, tmp_path):
    secret = "sk-test-SECRET-7f3a9c"
    monkeypatch.setenv("ACTIONOPD_TEST_TEACHER_KEY", secret)
    backend = ScriptedBackend("teacher", paris_call)
    caplog.set_level(logging.DEBUG)  # the openai/httpx debug logs too
    with serve(backend, api_key_env="ACTIONOPD_TEST_TEACHER_KEY") as server:
        teacher = teacher_for(server, api_key_env="ACTIONOPD_TEST_TEACHER_KEY")
        assert len(run(teacher.sample(STATE, TOOLS, 1))) == 1  # the server accepted the key
        assert secret not in repr(teacher) and secret not in str(teacher.identity)
        monkeypatch.setenv("ACTIONOPD_TEST_WRONG_KEY", "sk-wrong-" + secret[::-1])
        wrong = teacher_for(server, api_key_env="ACTIONOPD_TEST_WRONG_KEY")
        with pytest.raises(PermanentRequestError) as info:
            run(wrong.sample(STATE, TOOLS, 1))
        assert "401" in str(info.value) and secret[::-1] not in str(info.value)
    assert secret not in caplog.text
    monkeypatch.delenv("ACTIONOPD_TEST_TEACHER_KEY")
    with pytest.raises(ValueError, match="ACTIONOPD_TEST_TEACHER_KEY.*not set"):
        teacher_for(server, api_key_env="ACTIONOPD_TEST_TEACHER_KEY")


def test_mixed_fault_rates_accounting_is_exact():
    """Faults drawn at set rates from a seeded RNG over many concurrent states: whatever the
    interleaving, every HTTP attempt is accounted for and every returned sample is valid."""
    rates = FaultRates(rate_limit=0.15, server_error=0.15, malformed=0.1, invalid_tool_call=0.15, retry_after_s=0.01)
    injector = FaultInjector(rates, seed=11)
    backend = ScriptedBackend("teacher", paris_call)
    states = [STATE + [{"role": "user", "content": f"question {i}"}] for i in range(12)]
    with serve(backend, middleware=injector) as server:
        teacher = teacher_for(server, provider="deepseek",
                              retry=RetryPolicy(max_attempts=4, base_delay_s=0.005, max_delay_s=0.01))

        async def all_states():
            return await asyncio.gather(*(teacher.sample_detailed(s, TOOLS, 3) for s in states))

        batches = run(all_states())
    u = teacher.usage
    assert injector.requests_seen == u.http_calls
    transport_faults = injector.injected["rate_limit"] + injector.injected["server_error"] + injector.injected["malformed"]
    assert transport_faults > 0 and injector.injected["invalid_tool_call"] > 0
    # every transport fault was followed by a retry, or was the last attempt of a request that
    # gave up (then its slot counts as one transport failure)
    assert transport_faults == u.transport_retries + u.transport_failures
    assert u.invalid_replies == injector.injected["invalid_tool_call"]
    assert u.http_calls == sum(injector.injected.values())
    for b in batches:
        assert all(isinstance(s.action, ToolCall) for s in b.samples)  # only valid samples come back
        assert len(b.samples) + b.transport_failures <= 3
    assert sum(len(b.samples) for b in batches) >= 30  # the large majority of the 36 slots is filled
