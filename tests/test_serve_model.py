"""The model-backed server, driven by the real `openai` client over loopback.

The model is a tiny Qwen3 fitted in the fixture to two conversations (one answered with a
tool call), so tool-call parsing is exercised on tokens the model really generated. It is
served as `actionopd serve` serves by default: through the continuous-batching engine, whose
samples are the static sampler's (tests/test_engine_exact.py), so the replies pinned here are
the static sampler's too (the static path's batching: tests/test_serve_limits.py).

The server (tests/_serve_fixtures.py's `served`) also serves "endless", the same weights with
end tokens that never come; the streaming and slot tests that use it are in
test_serve_streaming.py.
"""

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from actionopd_jax.serve.model_backend import ModelBackend
from tests._serve_fixtures import (CHAT_CONVERSATION, MAX_CONTEXT, TOOL_CONVERSATION,  # noqa: F401  (served: a fixture)
                                   WEATHER_TOOL, served)


def _client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_tool_call_reply_is_parsed_into_tool_calls(served):
    server, _, _ = served
    r = _client(server).chat.completions.create(model="tiny-student", messages=TOOL_CONVERSATION,
                                                tools=[WEATHER_TOOL], temperature=0.0, logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content is None
    # logprobs of the generated tokens (end token excluded), each a finite log-probability
    lps = [t.logprob for t in choice.logprobs.content]
    assert len(lps) == r.usage.completion_tokens - 1 and all(np.isfinite(lps)) and max(lps) <= 0
    assert "".join(t.token for t in choice.logprobs.content).startswith("<tool_call>")
    assert r.usage.prompt_tokens > 50


def test_n_samples_and_plain_message(served):
    server, _, _ = served
    r = _client(server).chat.completions.create(model="tiny-student", messages=CHAT_CONVERSATION, n=3,
                                                temperature=0.8, extra_body={"top_k": 5, "top_p": 0.9}, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.message.content == "Hello! How can I help you today?" and c.message.tool_calls is None
        assert c.finish_reason == "stop"
    # tool_choice "none": the reply stays text even though it holds a tool-call block
    r = _client(server).chat.completions.create(model="tiny-student", messages=TOOL_CONVERSATION,
                                                tools=[WEATHER_TOOL], tool_choice="none", temperature=0.0)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


def test_stop_strings_max_tokens_and_seed(served):
    server, _, tokenizer = served
    client = _client(server)
    r = client.chat.completions.create(model="tiny-student", messages=CHAT_CONVERSATION, temperature=0.0,
                                       stop=["How"])
    assert r.choices[0].message.content == "Hello!" and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="tiny-student", messages=CHAT_CONVERSATION, temperature=0.0,
                                       max_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    # same seed -> same samples at a high temperature (where replies vary)
    kw = dict(model="tiny-student", messages=CHAT_CONVERSATION, temperature=3.0, n=2, max_tokens=8)
    a = client.chat.completions.create(seed=11, **kw)
    b = client.chat.completions.create(seed=11, **kw)
    c = client.chat.completions.create(seed=12, **kw)
    texts = lambda r: [ch.message.content for ch in r.choices]
    assert texts(a) == texts(b) and texts(a) != texts(c)


def _post(server, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(server.base_url + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_body_far_over_the_context_is_refused_before_it_is_tokenized(served, monkeypatch):
    """Issue 34: bodies under the size limit were tokenized first (8 MB: ~30 s, +4.6 GB). A
    rendered prompt whose UTF-8 bytes exceed the context times the vocabulary's longest token
    cannot fit: 400 without tokenizing (issue 46: the floor is taken over the rendered text,
    so bulk in any field counts); a prompt under that bound is tokenized and measured exactly."""
    server, backend, _ = served
    client = _client(server)
    longest = max(len(k.encode()) for k in backend.tokenizer.get_vocab())
    encoded = []
    real = backend.tokenizer.encode
    monkeypatch.setattr(backend.tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or real(text, **kw))
    huge = "w" * (longest * (backend.max_context + 1))
    with pytest.raises(openai.BadRequestError, match="the prompt has at least") as err:
        client.chat.completions.create(model="tiny-student", messages=[{"role": "user", "content": huge}])
    assert err.value.body["code"] == "context_length_exceeded" and encoded == []
    with pytest.raises(openai.BadRequestError, match="context too long: the prompt has [0-9]+ tokens"):
        client.chat.completions.create(model="tiny-student", messages=[{"role": "user", "content": "weather " *
                                                                         backend.max_context}])
    assert len(encoded) == 1   # under the floor's bound: tokenized, then refused from its exact count


def test_bad_requests_get_clean_4xx(served):
    server, backend, _ = served
    client = _client(server)
    long_text = "weather " * MAX_CONTEXT
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-student", messages=[{"role": "user", "content": long_text}])
    assert "context too long" in str(err.value) and err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="context too long"):
        client.chat.completions.create(model="tiny-student", messages=CHAT_CONVERSATION, max_tokens=MAX_CONTEXT)
    with pytest.raises(openai.BadRequestError, match="n=5 samples exceed the engine's 4 slots"):
        client.chat.completions.create(model="tiny-student", messages=CHAT_CONVERSATION, n=5, stream=True)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.chat.completions.create(model="other", messages=CHAT_CONVERSATION)
    status, body = _post(server, b"{oops")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _post(server, json.dumps({"model": "tiny-student"}).encode())
    assert status == 400 and "'messages' is required" in body["error"]["message"]
    status, body = _post(server, json.dumps({"model": "tiny-student", "messages": [
        {"role": "assistant", "tool_calls": "nope"}]}).encode())
    assert status == 400 and "tool_calls" in body["error"]["message"]
    # aiohttp's own 404 / 405 in OpenAI's error JSON too (issue 34: they were plain text)
    for method, path, status, code in (("GET", "/v1/nothing", 404, "not_found"),
                                       ("GET", "/v1/chat/completions", 405, "method_not_allowed")):
        req = urllib.request.Request(server.base_url.removesuffix("/v1") + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(req, timeout=60)
        assert http_err.value.code == status
        body = json.loads(http_err.value.read())
        assert body["error"]["code"] == code and path in body["error"]["message"], body
    assert "POST" in http_err.value.headers.get("Allow", "")


def test_concurrent_requests_share_the_engines_segments(served):
    server, backend, tokenizer = served
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    conversations = [(TOOL_CONVERSATION, [WEATHER_TOOL]), (CHAT_CONVERSATION, None)] * 3

    async def ask(conv, tools):
        return await client.chat.completions.create(model="tiny-student", messages=conv, tools=tools,
                                                    temperature=0.0, n=2)

    async def main():
        return await asyncio.gather(*(ask(c, t) for c, t in conversations))

    step0 = backend.runner.steps
    replies = asyncio.run(main())
    for (conv, tools), r in zip(conversations, replies):
        assert len(r.choices) == 2
        for c in r.choices:
            if tools:
                assert c.message.tool_calls[0].function.name == "get_weather"
            else:
                assert c.message.content == "Hello! How can I help you today?"
    # 6 requests of 2 samples in 4 slots: two ran together, the others joined as slots freed
    ran = [ids for step, ids in backend.runner.history if step > step0 and ids]
    assert max(len(ids) for ids in ran) == 2 and len({i for ids in ran for i in ids}) == 6, ran


def test_stream_of_a_generated_tool_call_assembles_to_the_plain_reply(served):
    from tests.test_openai_http import _assemble, _as_assembled

    server, _, _ = served
    client = _client(server)
    kw = dict(model="tiny-student", messages=TOOL_CONVERSATION, tools=[WEATHER_TOOL], temperature=0.0)
    plain = _as_assembled(client.chat.completions.create(**kw).choices[0])
    (streamed,) = _assemble(client.chat.completions.create(stream=True, **kw)).values()
    assert streamed["calls"][0]["id"].startswith("call_")
    for reply in (plain, streamed):  # call ids are fresh per reply
        reply["calls"][0].pop("id")
    assert streamed == plain and plain["calls"][0]["name"] == "get_weather" and plain["finish"] == "tool_calls"


def test_top_logprobs_are_the_most_likely_alternatives(served):
    server, _, _ = served
    client = _client(server)
    for temperature in (0.0, 2.0):
        r = client.chat.completions.create(model="tiny-student", messages=CHAT_CONVERSATION, temperature=temperature,
                                           seed=1, max_tokens=12, logprobs=True, top_logprobs=4)
        content = r.choices[0].logprobs.content
        assert len(content) >= 5  # (a sampled reply may end early)
        for tok in content:
            alts = tok.top_logprobs
            lps = [a.logprob for a in alts]
            assert len(alts) == 4 and lps == sorted(lps, reverse=True) and max(lps) <= 0
            assert np.exp(lps).sum() <= 1 + 1e-5 and len({a.token for a in alts}) == 4
            if temperature == 0.0:  # greedy: the chosen token is the most likely one
                assert alts[0].token == tok.token
            chosen = [a.logprob for a in alts if a.token == tok.token]
            if chosen:  # the same distribution as the reported logprob (at the sampling temperature)
                assert abs(chosen[0] - tok.logprob) < 1e-3
    # sampling at T=2 flattens the distribution the alternatives are reported under
    assert content[0].top_logprobs[0].logprob < -0.05


def test_max_context_beyond_the_model_is_refused_at_start(served):
    _, backend, tokenizer = served
    with pytest.raises(ValueError, match=f"max_context {MAX_CONTEXT + 1} must be between 1 and the model's "
                                         f"context \\(max_position_embeddings {MAX_CONTEXT}\\)"):
        ModelBackend(backend.sampler, tokenizer, max_context=MAX_CONTEXT + 1)


STOCK_TOOL = {"type": "function", "function": {
    "name": "get_stock_price", "description": "Price of a stock.",
    "parameters": {"type": "object", "properties": {"symbol": {"type": "string"}}, "required": ["symbol"]}}}


def test_tool_choice_forces_the_named_or_a_required_call_and_none_forbids_it(served):
    """OpenAI's tool_choice semantics (issue 26): the fitted model answers the weather question
    with get_weather and the greeting with text; forcing changes what it must call."""
    server, _, _ = served
    client = _client(server)
    ask = lambda conv, tools, choice: client.chat.completions.create(
        model="tiny-student", messages=conv, tools=tools, tool_choice=choice, temperature=0.0).choices[0]
    # a named function: the reply calls exactly it, even where the model would call another
    forced = {"type": "function", "function": {"name": "get_stock_price"}}
    c = ask(TOOL_CONVERSATION, [WEATHER_TOOL, STOCK_TOOL], forced)
    assert [t.function.name for t in c.message.tool_calls] == ["get_stock_price"]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    # ... and where it would answer in text
    c = ask(CHAT_CONVERSATION, [WEATHER_TOOL], {"type": "function", "function": {"name": "get_weather"}})
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    # required: some call among the offered tools (the likeliest: get_weather for the weather question)
    c = ask(TOOL_CONVERSATION, [STOCK_TOOL, WEATHER_TOOL], "required")
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    c = ask(CHAT_CONVERSATION, [WEATHER_TOOL], "required")
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    # none: no call, the text stays content
    c = ask(TOOL_CONVERSATION, [WEATHER_TOOL], "none")
    assert c.message.tool_calls is None and "get_weather" in c.message.content


def test_a_call_to_a_tool_that_was_not_offered_is_never_structured(served):
    """The model writes a get_weather call; the request offered only get_stock_price: the
    block stays in the content (the client's parser sees the unknown name), finish 'stop'."""
    server, _, _ = served
    c = _client(server).chat.completions.create(model="tiny-student", messages=TOOL_CONVERSATION,
                                                tools=[STOCK_TOOL], temperature=0.0).choices[0]
    assert c.message.tool_calls is None and '"get_weather"' in c.message.content and c.finish_reason == "stop"


def test_tool_choice_without_tools_or_naming_an_unoffered_tool_is_a_400(served):
    server, _, _ = served
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match="not among the offered 'tools'"):
        client.chat.completions.create(model="tiny-student", messages=TOOL_CONVERSATION, tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "get_watchlist"}})
    for choice in ("required", "auto", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError, match="only allowed when 'tools' are given"):
            client.chat.completions.create(model="tiny-student", messages=TOOL_CONVERSATION, tool_choice=choice)
    status, body = _post(server, json.dumps({"model": "tiny-student", "messages": TOOL_CONVERSATION,
                                             "tools": [WEATHER_TOOL], "tool_choice": "sometimes"}).encode())
    assert status == 400 and "'tool_choice' must be" in body["error"]["message"]
