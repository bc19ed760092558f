"""The OpenAI-compatible HTTP layer, driven by the real `openai` client over loopback."""

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest

from actionopd_jax.serve.openai_http import ChatChoice, ChatRequest, OpenAIServer, RequestError
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice, tool_call_choice

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "weather in Paris?"}]


def _reply(req: ChatRequest):
    if req.tools:
        return tool_call_choice("get_weather", {"city": "Paris"})
    return message_choice(f"echo {req.messages[-1]['content']}", reasoning="thinking")


@pytest.fixture()
def server():
    backend = ScriptedBackend("scripted", _reply)
    with OpenAIServer(backend) as srv:
        yield srv, backend


def test_completions_messages_tool_calls_and_n(server):
    srv, backend = server
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused")
    r = client.chat.completions.create(model="scripted", messages=USER, n=3, temperature=0.7, max_tokens=5)
    assert [c.message.content for c in r.choices] == ["echo weather in Paris?"] * 3
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.choices[0].message.model_extra["reasoning_content"] == "thinking"
    assert backend.requests[-1].temperature == 0.7 and backend.requests[-1].max_tokens == 5

    r = client.chat.completions.create(model="scripted", messages=USER, tools=TOOLS,
                                       extra_body={"top_k": 20})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls"
    assert backend.requests[-1].top_k == 20
    assert [m.id for m in client.models.list()] == ["scripted"]
    assert srv.request_count == 2


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b"{not json", 400, "not valid JSON"),
        (json.dumps({"model": "scripted"}).encode(), 400, "'messages' is required"),
        (json.dumps({"model": "nope", "messages": USER}).encode(), 404, "model 'nope' not found"),
        (json.dumps({"model": "scripted", "messages": USER, "n": 0}).encode(), 400, "'n' must be between"),
        (json.dumps({"model": "scripted", "messages": USER, "temperature": "hot"}).encode(), 400, "'temperature' must be a number"),
        (json.dumps({"model": "scripted", "messages": [{"role": "robot"}]}).encode(), 400, "messages[0]"),
        # settings the sampler does not apply are refused, not silently ignored
        (json.dumps({"model": "scripted", "messages": USER, "presence_penalty": 0.5}).encode(), 400,
         "'presence_penalty' is not applied"),
        (json.dumps({"model": "scripted", "messages": USER, "response_format": {"type": "json_object"}}).encode(),
         400, "'response_format' other than"),
        (json.dumps({"model": "scripted", "messages": USER, "logit_bias": {"1": 5}}).encode(), 400,
         "'logit_bias' is not applied"),
    ],
)
def test_bad_requests_get_json_4xx(server, body, status, needle):
    srv, _ = server
    req = urllib.request.Request(srv.base_url + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == status
    assert needle in json.loads(e.value.read())["error"]["message"]
    assert srv.request_count == 0


def test_backend_request_error_and_crash_are_reported():
    def reply(req):
        if req.messages[-1]["content"] == "long":
            raise RequestError(400, "context too long: 9000 tokens > 4096", code="context_length_exceeded")
        raise ZeroDivisionError("boom")

    with OpenAIServer(ScriptedBackend("m", reply)) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="context too long"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "long"}])
        with pytest.raises(openai.InternalServerError, match="ZeroDivisionError"):
            client.chat.completions.create(model="m", messages=USER)


def test_bearer_token_from_environment(monkeypatch):
    monkeypatch.setenv("TEST_SERVER_KEY", "s3cret-value")
    with OpenAIServer(ScriptedBackend("m", _reply), api_key_env="TEST_SERVER_KEY") as srv:
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0).models.list()
        assert "s3cret-value" not in str(e.value)
        ok = openai.OpenAI(base_url=srv.base_url, api_key="s3cret-value")
        assert ok.chat.completions.create(model="m", messages=USER).choices[0].message.content
    monkeypatch.delenv("TEST_SERVER_KEY")
    with pytest.raises(ValueError, match="TEST_SERVER_KEY"):
        OpenAIServer(ScriptedBackend("m", _reply), api_key_env="TEST_SERVER_KEY")


def test_middleware_can_inject_faults():
    calls = {"n": 0}

    async def flaky(body):
        calls["n"] += 1
        if calls["n"] == 1:
            return 429, {"error": {"message": "slow down"}}, {"Retry-After": "0"}
        return None

    with OpenAIServer(ScriptedBackend("m", _reply), middleware=flaky) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=2)
        r = client.chat.completions.create(model="m", messages=USER)
        assert r.choices[0].message.content == "echo weather in Paris?"
        assert calls["n"] == 2 and srv.request_count == 1


def test_concurrent_requests_each_get_their_own_answer(server):
    srv, _ = server

    async def main():
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="x")
        msgs = [[{"role": "user", "content": f"q{i}"}] for i in range(16)]
        rs = await asyncio.gather(*(client.chat.completions.create(model="scripted", messages=m) for m in msgs))
        return [r.choices[0].message.content for r in rs]

    assert asyncio.run(main()) == [f"echo q{i}" for i in range(16)]


def test_port_in_use_is_a_clear_error(server):
    srv, _ = server
    with pytest.raises(RuntimeError, match="could not start server"):
        OpenAIServer(ScriptedBackend("m", _reply), port=srv.port).start()


def _assemble(chunks):
    """Join streamed deltas into messages the way a client does: per choice index, content
    and reasoning concatenated, tool calls by index (id/name once, arguments concatenated)."""
    out = {}
    for chunk in chunks:
        for c in chunk.choices:
            m = out.setdefault(c.index, {"role": None, "content": "", "reasoning": "", "calls": {}, "finish": None})
            d = c.delta
            m["role"] = d.role or m["role"]
            m["content"] += d.content or ""
            m["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                call = m["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            m["finish"] = c.finish_reason or m["finish"]
    return out


def _as_assembled(choice):
    msg = choice.message
    calls = {k: {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for k, c in enumerate(msg.tool_calls or [])}
    return {"role": "assistant", "content": msg.content or "", "calls": calls, "finish": choice.finish_reason,
            "reasoning": (msg.model_extra or {}).get("reasoning_content") or ""}


def test_stream_yields_chunks_that_assemble_to_the_message():
    long_args = {"city": "Paris", "note": "x" * 70, "days": [1, 2, 3]}

    def reply(req):
        if req.tools:  # fixed call ids, so the streamed and plain replies can be compared whole
            calls = [{"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                     for k, (name, args) in enumerate([("get_weather", long_args), ("get_time", {"tz": "CET"})])]
            return ChatChoice(content="Checking two things for you, one moment.", tool_calls=calls,
                              reasoning_content="the user wants weather and time")
        return message_choice("A plain answer that is longer than one streamed piece.", reasoning="short")

    with OpenAIServer(ScriptedBackend("m", reply)) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        for tools in (TOOLS, None):
            plain = client.chat.completions.create(model="m", messages=USER, tools=tools, n=2)
            chunks = list(client.chat.completions.create(model="m", messages=USER, tools=tools, n=2, stream=True,
                                                         stream_options={"include_usage": True}))
            assert len(chunks) > 8 and all(c.object == "chat.completion.chunk" for c in chunks)
            assert len({c.id for c in chunks}) == 1
            assembled = _assemble(chunks)
            assert assembled == {c.index: _as_assembled(c) for c in plain.choices}
            assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens
        assert assembled[0]["finish"] == "stop" and _assemble(chunks)[1]["content"].startswith("A plain")
        # without include_usage there is no usage chunk; a bad streamed request is still a 400
        chunks = list(client.chat.completions.create(model="m", messages=USER, stream=True))
        assert all(c.choices for c in chunks) and chunks[-1].choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="'n' must be between"):
            client.chat.completions.create(model="m", messages=USER, n=0, stream=True)


def test_parallel_tool_calls_false_keeps_the_first_call():
    """OpenAI's `parallel_tool_calls: false`: at most one call a reply (the first, as vLLM keeps
    it), plain and streamed; true or absent returns every call; a non-boolean is a 400."""
    calls = [{"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": "{}"}}
             for k, name in enumerate(("get_weather", "get_time"))]
    with OpenAIServer(ScriptedBackend("m", lambda req: ChatChoice(content=None, tool_calls=list(calls)))) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        for parallel, names in ((None, ["get_weather", "get_time"]), (True, ["get_weather", "get_time"]),
                                (False, ["get_weather"])):
            extra = {} if parallel is None else {"parallel_tool_calls": parallel}
            plain = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, **extra)
            assert [c.function.name for c in plain.choices[0].message.tool_calls] == names, parallel
            assert plain.choices[0].finish_reason == "tool_calls"
            streamed = _assemble(client.chat.completions.create(model="m", messages=USER, tools=TOOLS, stream=True,
                                                                **extra))
            assert [c["name"] for _, c in sorted(streamed[0]["calls"].items())] == names, parallel
        with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
            client.chat.completions.create(model="m", messages=USER, tools=TOOLS, parallel_tool_calls="no")


def test_stream_sse_framing_and_done_marker(server):
    srv, _ = server
    body = json.dumps({"model": "scripted", "messages": USER, "tools": TOOLS, "stream": True}).encode()
    req = urllib.request.Request(srv.base_url + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = resp.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    first_call = next(p["choices"][0]["delta"]["tool_calls"][0] for p in payloads
                      if p["choices"][0]["delta"].get("tool_calls"))
    assert first_call["index"] == 0 and first_call["function"] == {"name": "get_weather", "arguments": ""}
    assert payloads[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_neutral_values_of_unapplied_settings_are_accepted(server):
    """AppWorld sends penalties of 0 and a text response_format: those are what we do anyway."""
    srv, backend = server
    client = openai.OpenAI(base_url=srv.base_url, api_key="x")
    client.chat.completions.create(model="scripted", messages=USER, frequency_penalty=0, presence_penalty=0.0,
                                   response_format={"type": "text"})
    assert backend.requests[-1].raw["frequency_penalty"] == 0


def test_top_logprobs_needs_logprobs_and_stream_options_need_stream(server):
    srv, _ = server
    client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' needs 'logprobs': true"):
        client.chat.completions.create(model="scripted", messages=USER, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="'stream_options' is only allowed"):
        client.chat.completions.create(model="scripted", messages=USER, stream_options={"include_usage": True})


def test_large_bodies_are_read_a_few_at_a_time_while_small_ones_pass():
    """Issue 34 item 1: bodies over 1 MiB are read and parsed at most max_large_bodies at once;
    the others wait unread (bounded memory), small requests are not held up by them."""
    import threading
    import time as _time

    backend = ScriptedBackend("m", lambda req: message_choice(f"{len(req.messages[0]['content'])} chars"))
    srv = OpenAIServer(backend, max_large_bodies=1)
    srv.start()

    async def hold():   # the one slot, taken by the test (on the server's loop, as a request would)
        if srv._large_bodies is None:
            srv._large_bodies = asyncio.Semaphore(srv.max_large_bodies)
        await srv._large_bodies.acquire()

    async def release():
        srv._large_bodies.release()

    try:
        asyncio.run_coroutine_threadsafe(hold(), srv._loop).result(timeout=10)
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
        got = {}
        big = threading.Thread(target=lambda: got.update(big=client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "w" * (2 << 20)}])))
        big.start()
        deadline = _time.monotonic() + 60
        while srv.large_bodies_waiting < 1 and _time.monotonic() < deadline:   # the condition, not a sleep
            _time.sleep(0.01)
        assert srv.large_bodies_waiting == 1 and "big" not in got   # it waits, unread
        small = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert small.choices[0].message.content == "2 chars" and "big" not in got
        asyncio.run_coroutine_threadsafe(release(), srv._loop).result(timeout=10)
        big.join(timeout=120)
        assert got["big"].choices[0].message.content == f"{2 << 20} chars" and srv.large_bodies_waiting == 0
    finally:
        srv.stop()
