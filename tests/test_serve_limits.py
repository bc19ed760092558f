"""Server limits: a client that disconnects stops holding the device, and a --max-context the
model cannot take is refused at start-up (not answered with a 500 per request); a body far
over the context is refused before it is tokenized, whichever field carries its bulk, and a
large body holds its read slot until its prompt is tokenized (issue 46)."""

import asyncio
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import openai
import pytest

from actionopd_jax.sampling import Buckets, Sampler
from actionopd_jax.serve.model_backend import ModelBackend
from actionopd_jax.serve.openai_http import OpenAIServer
from tests._sampler_fixtures import random_model
from tests._serve_fixtures import CHAT_CONVERSATION, build_tokenizer

SEGMENT = 16
LONG = 400  # tokens the abandoned request asks for: 25 segments
# one shape per program kind: continuations re-prefill into the same 512-token bucket
BUCKETS = Buckets(prompt_len=(512,), prompts=(2,), samples=(1,), max_new=(SEGMENT,))


class CountingSampler:
    """The real sampler, with a record of the tokens each device call generated."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[list[int], int]] = []  # (max_new_tokens per prompt, tokens generated)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def sample(self, prompts, **kw):
        result = self.inner.sample(prompts, **kw)
        self.calls.append((list(kw["max_new_tokens"]), result.generated_tokens))
        return result


class WatchedTokenizer:
    """The real tokenizer, with a record of the lengths of the texts it encoded; while `gate` is
    set, each encode waits for it (the test holds a request mid-tokenizing)."""

    def __init__(self, inner):
        self.inner = inner
        self.encoded: list[int] = []
        self.entered = threading.Event()
        self.gate: threading.Event | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, **kw):
        self.encoded.append(len(text))
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(120), "the test never opened the gate"
        return self.inner.encode(text, **kw)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("limits"))
    # random weights and no end tokens: every request generates exactly what it asks for
    model = random_model(0, vocab_size=len(tokenizer), max_position_embeddings=512)
    sampler = CountingSampler(Sampler(model, eos_ids=[], buckets=BUCKETS, lm_head="float32"))
    backend = ModelBackend(sampler, tokenizer, model_name="rand", segment_tokens=SEGMENT, batch_window_s=0.1)
    with OpenAIServer(backend) as server:
        yield server, backend, sampler


def test_disconnected_request_stops_and_the_next_is_served_promptly(served):
    server, backend, sampler = served
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    kw = dict(model="rand", messages=CHAT_CONVERSATION, temperature=1.0)
    client.chat.completions.create(max_tokens=SEGMENT, **kw)  # compiles
    sampler.calls.clear()
    start = time.perf_counter()
    full = client.chat.completions.create(max_tokens=LONG, **kw)
    full_s = time.perf_counter() - start
    assert full.usage.completion_tokens == LONG

    sampler.calls.clear()
    impatient = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                              timeout=openai.Timeout(full_s / 8, connect=5.0))  # the client's own type
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(max_tokens=LONG, **kw)
    start = time.perf_counter()
    quick = client.chat.completions.create(max_tokens=SEGMENT, **kw)
    quick_s = time.perf_counter() - start
    assert quick.usage.completion_tokens == SEGMENT
    calls = -1
    while calls != len(sampler.calls):  # until no device call has run for several segments' time
        calls = len(sampler.calls)
        time.sleep(max(0.2, full_s / 5))
    abandoned_tokens = sum(made for _, made in sampler.calls) - SEGMENT
    # the abandoned request stopped within a segment of its client leaving (it would have made
    # LONG tokens), and the next request waited for at most that segment, not for the rest
    assert abandoned_tokens < LONG // 2, (abandoned_tokens, sampler.calls)
    assert backend.batcher.abandoned == 1
    print(f"full {full_s:.2f} s, next after abandon {quick_s:.2f} s, abandoned tokens {abandoned_tokens}")
    assert quick_s < full_s / 3, (quick_s, full_s)


def test_concurrent_long_requests_share_segments_and_finish(served):
    server, backend, sampler = served
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)

    async def main():
        return await asyncio.gather(*(client.chat.completions.create(
            model="rand", messages=CHAT_CONVERSATION, max_tokens=n, seed=s) for n, s in ((40, 1), (24, 2))))

    sampler.calls.clear()
    replies = asyncio.run(main())
    assert [r.usage.completion_tokens for r in replies] == [40, 24]
    assert sampler.calls[0][0] == [SEGMENT, SEGMENT]  # both in one call, a segment each


def test_serve_refuses_a_max_context_beyond_the_model():
    proc = subprocess.run([sys.executable, "-m", "actionopd_jax.commands", "serve", "--tiny", "--seed", "1",
                           "--port", "0", "--max-context", "100000"],
                          capture_output=True, text=True, timeout=180, env=dict(os.environ))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "max_context 100000 must be between 1 and the model's context" in proc.stderr


BULK = "weather " * 12_500   # 100 KB: a floor of over 1,600 tokens against a 512-token context


def _tool_heavy(kind: str) -> dict:
    """A chat body whose bulk is in one text-bearing field other than message content."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    reasoning = None
    if kind == "tool_call_arguments":
        call["function"]["arguments"] = json.dumps({"city": BULK})
    elif kind == "tool_call_name":
        call["function"]["name"] = "get_" + BULK.replace(" ", "_")
    elif kind == "tool_schemas":
        tool["function"]["parameters"]["properties"]["city"]["description"] = BULK
    elif kind == "shown_reasoning":
        reasoning = BULK
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call],
                 **({"reasoning_content": reasoning} if reasoning else {})}]
    if kind != "shown_reasoning":   # the reasoning of the last assistant turn is shown while it is the last
        messages.append({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
    return {"messages": messages, "tools": [tool]}


@pytest.mark.parametrize("kind", ["tool_call_arguments", "tool_call_name", "tool_schemas", "shown_reasoning"])
def test_a_tool_heavy_body_is_refused_before_the_tokenizer_runs(served, kind):
    """Issue 46 item 1: the early refusal counted message content only, so bulk in tool-call
    arguments or tool schemas was tokenized first (7.5 MB: 40 s, +1.3 GB each). The floor now
    comes from the rendered prompt, every field the model reads: the tokenizer never sees it."""
    _, backend, sampler = served
    tokenizer = WatchedTokenizer(backend.tokenizer)
    watched = ModelBackend(sampler.inner, tokenizer, model_name="rand", segment_tokens=SEGMENT)
    with OpenAIServer(watched) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="rand", max_tokens=SEGMENT, **_tool_heavy(kind))
    error = refused.value.body
    assert error["code"] == "context_length_exceeded", error
    assert error["message"].startswith("context too long: the prompt has at least "), error["message"]
    assert "the model's context is 512 tokens; shorten the conversation or the tools" in error["message"]
    assert tokenizer.encoded == []


def test_a_large_body_holds_its_slot_until_tokenized_and_bulk_the_template_leaves_out_fits(served):
    """Issue 46 item 1: --max-large-bodies let a body go once it was parsed, so bodies were
    tokenized side by side however many there were. Now a large body's slot is held until its
    prompt is tokenized. The bodies here carry 3 MB in fields the chat template does not render
    (tool_call ids, a message name, an earlier turn's reasoning): the floor, taken over the
    rendered prompt, does not count them, and they are answered."""
    _, backend, sampler = served
    tokenizer = WatchedTokenizer(backend.tokenizer)
    tokenizer.gate = threading.Event()
    watched = ModelBackend(sampler.inner, tokenizer, model_name="rand", segment_tokens=SEGMENT)
    call_id = "call_" + "x" * (1 << 20)
    messages = [{"role": "user", "content": "Weather?", "name": "n" * (1 << 20)},
                {"role": "assistant", "content": None, "reasoning_content": "r" * (1 << 20),
                 "tool_calls": [{"id": call_id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
                {"role": "user", "content": "Thanks. And in Rome?"}]
    replies: list[object] = []
    with OpenAIServer(watched, max_large_bodies=1) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)

        def ask():
            try:
                replies.append(client.chat.completions.create(model="rand", messages=messages, max_tokens=SEGMENT))
            except Exception as e:  # noqa: BLE001 - the outcome is what the test inspects
                replies.append(e)

        first, second = threading.Thread(target=ask), threading.Thread(target=ask)
        first.start()
        assert tokenizer.entered.wait(60)   # the first body is being tokenized, its slot held
        second.start()
        deadline = time.monotonic() + 60
        while server.large_bodies_waiting < 1 and len(tokenizer.encoded) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)   # the condition, not a sleep: the second body waits, or (the old way) tokenizes
        waiting, encoded = server.large_bodies_waiting, list(tokenizer.encoded)
        tokenizer.gate.set()
        first.join(timeout=120)
        second.join(timeout=120)
    assert (waiting, len(encoded)) == (1, 1), (waiting, encoded)
    assert encoded[0] < 2000   # what the template renders: the 3 MB it leaves out is not tokenized
    assert len(replies) == 2 and all(r.usage.completion_tokens == SEGMENT for r in replies), replies
    assert len(tokenizer.encoded) == 2 and server.large_bodies_waiting == 0


def _post_raw(base_url: str, route: str, body: bytes) -> tuple[int, str, str]:
    url = urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        conn.request("POST", url.path.rstrip("/") + route, body=body, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, reply.getheader("Content-Type", ""), reply.read().decode()
    finally:
        conn.close()


@pytest.mark.parametrize("depth", [30_000, 100_000])   # parsed on the event loop / in a worker thread
@pytest.mark.parametrize("route", ["/chat/completions", "/completions"])
def test_deeply_nested_json_gets_a_json_400(served, route, depth):
    """Issue 46 item 8: 100,000 nested arrays made Python's JSON parser raise RecursionError,
    which aiohttp answered as a plain-text 500."""
    server, _, _ = served
    body = b'{"model": "rand", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    status, content_type, text = _post_raw(server.base_url, route, body)
    assert status == 400 and content_type.startswith("application/json"), (status, content_type, text[:300])
    error = json.loads(text)["error"]
    assert error["code"] == "json_too_deep" and error["type"] == "invalid_request_error"
    assert "nests arrays/objects too deeply to parse" in error["message"] and "send a flatter body" in error["message"]


def test_nesting_near_the_parser_limit_is_served_or_refused_in_json(served):
    """Nesting the parser still takes may be too deep to render (the template's JSON dump adds
    frames of its own): whatever the depth, the answer is a reply or a JSON 400, never a 500."""
    server, _, _ = served
    outcomes = set()
    for depth in range(940, 1001, 6):
        nested = "[" * depth + "]" * depth
        body = ('{"model": "rand", "max_tokens": %d, "messages": [{"role": "user", "content": "hi"}, '
                '{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": '
                '{"name": "f", "arguments": {"a": %s}}}]}, {"role": "tool", "tool_call_id": "c", "content": "ok"}]}'
                % (SEGMENT, nested))
        status, content_type, text = _post_raw(server.base_url, "/chat/completions", body.encode())
        assert status in (200, 400) and content_type.startswith("application/json"), (depth, status, text[:300])
        outcomes.add((status, json.loads(text).get("error", {}).get("code")))
    print(outcomes)
