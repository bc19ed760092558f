"""Streaming and engine slots (issue 25) on the model-backed server, driven by the real `openai`
client over loopback, and serve's warm-up (issue 34 item 9).

The server is tests/_serve_fixtures.py's `served` (shared with test_serve_model.py, which pins
the replies themselves). These tests talk to its second model, "endless": the same weights with
end tokens that never come, so every request makes all the tokens it asks for.
"""

import threading
import time

import numpy as np
import openai

from actionopd_jax.engine import Engine, EngineConfig
from actionopd_jax.sampling.loading import end_token_ids
from actionopd_jax.serve.model_backend import ModelBackend
from tests._serve_fixtures import CHAT_CONVERSATION, MAX_CONTEXT, SHAPES, served  # noqa: F401  (served: a fixture)


def _client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


LONG = 320
KW = dict(model="endless", messages=CHAT_CONVERSATION, temperature=1.0)


def test_streamed_text_arrives_while_the_request_is_still_generating(served):
    server, _, _ = served
    backend, client = server.backends["endless"], _client(server)
    # the same request unstreamed first: any program this request mix still has to compile is
    # compiled then, so the timing below is generation alone; it is also the reference reply
    plain = client.chat.completions.create(max_tokens=LONG, seed=5, **KW).choices[0].message
    start = time.perf_counter()
    arrivals = []  # (seconds since the request, text of the chunk)
    for chunk in client.chat.completions.create(max_tokens=LONG, seed=5, stream=True, **KW):
        for c in chunk.choices:
            text = (c.delta.content or "") + ((c.delta.model_extra or {}).get("reasoning_content") or "")
            arrivals.append((time.perf_counter() - start, text, c.finish_reason))
    total = arrivals[-1][0]
    texts = [t for t, text, _ in arrivals if text]
    assert arrivals[-1][2] == "length"
    # the first text is there well before the end, and text keeps arriving segment by segment
    assert texts[0] < 0.5 * total, (texts[0], total, arrivals[:3])
    assert len({round(t, 3) for t in texts}) >= 5, arrivals
    # the streamed reply is the non-streamed one (same seed, same tokens)
    assert "".join(text for _, text, _ in arrivals) == (plain.content or "") + (
        (plain.model_extra or {}).get("reasoning_content") or "")
    print(f"first text {texts[0]:.3f} s of {total:.3f} s, {len(texts)} text chunks")


def test_a_client_that_leaves_frees_its_slot_within_one_segment(served):
    server, _, _ = served
    backend, client = server.backends["endless"], _client(server)
    runner = backend.runner
    made_before = backend.sampler.stats.generated_tokens
    seen = []
    stream = client.chat.completions.create(max_tokens=LONG, seed=1, stream=True, **KW)
    for chunk in stream:
        seen.append(chunk)
        if any(c.delta.content for c in chunk.choices):
            break
    (rid,) = runner.history[-1][1]
    stream.close()  # the client leaves mid-generation
    deadline = time.time() + 30
    while runner._thread is not None and time.time() < deadline:  # until the engine is idle
        time.sleep(0.005)
    # the server withdrew it when it saw the client go; it ran at most in the segment then in
    # flight, and its slot was free for the next one
    (at,) = [step for r, step in runner.withdrawn if r == rid]
    last = max(step for step, ids in runner.history if rid in ids)
    print(f"withdrawn after step {at}; the request last ran in step {last}")
    assert last <= at + 1, (at, last, list(runner.history)[-5:])
    assert all(rid not in ids for step, ids in runner.history if step > at + 1)
    assert backend.sampler.stats.generated_tokens - made_before < LONG // 4  # it never made its LONG tokens
    assert not backend.sampler.running and sorted(backend.sampler._free_slots) == list(range(SHAPES.slots))


def test_requests_join_and_leave_between_segments_with_their_own_tokens(served):
    """A streams a long reply; once its text flows, B and C arrive and join its segments, and
    leave before it ends. Each gets exactly the tokens (and logprobs) it gets alone."""
    server, _, _ = served
    backend, client = server.backends["endless"], _client(server)
    runs = {"A": (LONG, 21), "B": (48, 22), "C": (40, 23)}

    def tokens(choice_logprobs):
        return [t.token for t in choice_logprobs.content], [t.logprob for t in choice_logprobs.content]

    alone = {name: tokens(client.chat.completions.create(max_tokens=n, seed=s, logprobs=True, **KW)
                          .choices[0].logprobs) for name, (n, s) in runs.items()}
    together, threads = {}, []
    step0 = backend.runner.steps

    def ask(name):
        n, s = runs[name]
        together[name] = tokens(client.chat.completions.create(max_tokens=n, seed=s, logprobs=True, **KW)
                                .choices[0].logprobs)

    for chunk in client.chat.completions.create(max_tokens=LONG, seed=21, logprobs=True, stream=True, **KW):
        (c,) = chunk.choices
        if c.delta.content and not threads:  # A is generating: B and C arrive
            threads = [threading.Thread(target=ask, args=(name,)) for name in "BC"]
            for t in threads:
                t.start()
        if c.finish_reason:
            together["A"] = tokens(c.logprobs)
    for t in threads:
        t.join(timeout=60)
    for name in runs:
        assert together[name][0] == alone[name][0], name
        np.testing.assert_allclose(together[name][1], alone[name][1], atol=1e-5)
    # segment by segment, who ran: A alone, then B and C joined it, then A alone again after they left
    history = [ids for step, ids in backend.runner.history if step > step0 and ids]
    a = history[0]
    assert len(a) == 1 and history[-1] == a, history
    assert max(len(ids) for ids in history) == 3, history


def test_a_stop_string_ends_the_engine_request_early(served):
    """A reply that holds a stop string needs no more tokens: the request leaves the engine
    instead of running to max_tokens (the static path generates them all, then cuts)."""
    server, _, _ = served
    backend, client = server.backends["endless"], _client(server)
    before = backend.sampler.stats.generated_tokens
    for stream in (False, True):
        r = client.chat.completions.create(model="endless", messages=CHAT_CONVERSATION, temperature=0.0, stop=["How"],
                                           max_tokens=LONG, stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == "Hello!" and chunks[-1].choices[0].finish_reason == "stop"
        else:
            assert r.choices[0].message.content == "Hello!" and r.choices[0].finish_reason == "stop"
    assert backend.sampler.stats.generated_tokens - before < LONG // 4


def test_warm_up_compiles_what_the_first_request_needs(served):
    """Issue 34 item 9: serve compiled on its first request. `warm_up` (run by `actionopd serve`
    before it reports ready, unless --no-warmup) compiles the programs; the first real request
    then compiles nothing (an engine of shapes no other test uses, so nothing is cached)."""
    import asyncio

    from actionopd_jax.serve.requests import ChatRequest

    _, backend, tokenizer = served
    engine = Engine(backend.sampler.model, eos_ids=end_token_ids(tokenizer),
                    config=EngineConfig(slots=3, page_size=16, max_len=MAX_CONTEXT, chunk=64, prefill_lanes=1, segment=5))
    fresh = ModelBackend(engine, tokenizer, model_name="fresh", default_max_tokens=8)
    assert engine.compile_count == 0
    assert fresh.warm_up() > 0
    compiled = engine.compile_count
    assert compiled >= 2, compiled                      # a prefill chunk and a decode segment at least
    asyncio.run(fresh.complete(ChatRequest(model="fresh", messages=CHAT_CONVERSATION, max_tokens=8)))
    assert engine.compile_count == compiled
