"""The server generating through the continuous-batching engine (issue 25, "serve"), driven by
the real `openai` client over loopback.

1. The model-backed server's tests (test_serve_model.py) run again with an Engine in place of
   the static sampler: the engine's samples are the static sampler's, so the same replies,
   tool calls, stop strings, seeds, top_logprobs and tool_choice hold.
2. On a random model that never ends (no end tokens): streamed text reaches the client while
   the request is still generating; a client that leaves frees its slot within one segment;
   requests that arrive at different times share segments and each gets the tokens it gets alone.
"""

import threading
import time

import numpy as np
import openai
import pytest

from actionopd_jax.engine import Engine, EngineConfig
from actionopd_jax.sampling.loading import end_token_ids
from actionopd_jax.serve.model_backend import ModelBackend
from actionopd_jax.serve.openai_http import OpenAIServer
from tests._sampler_fixtures import random_model
from tests._serve_fixtures import CHAT_CONVERSATION, MAX_CONTEXT, build_tokenizer, trained_model
# the static server's tests, collected again here against the `served` fixture below
from tests.test_serve_model import (test_a_call_to_a_tool_that_was_not_offered_is_never_structured,  # noqa: F401
                                    test_bad_requests_get_clean_4xx, test_n_samples_and_plain_message,
                                    test_stop_strings_max_tokens_and_seed,
                                    test_stream_of_a_generated_tool_call_assembles_to_the_plain_reply,
                                    test_tool_call_reply_is_parsed_into_tool_calls,
                                    test_tool_choice_forces_the_named_or_a_required_call_and_none_forbids_it,
                                    test_top_logprobs_are_the_most_likely_alternatives)

SEGMENT = 8
LONG = 320


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("serve-engine"))
    model = trained_model(tokenizer)
    engine = Engine(model, eos_ids=end_token_ids(tokenizer),
                    config=EngineConfig(slots=4, page_size=16, max_len=MAX_CONTEXT, chunk=128, prefill_lanes=2,
                                        segment=SEGMENT))
    backend = ModelBackend(engine, tokenizer, model_name="tiny-student", default_max_tokens=48)
    with OpenAIServer(backend) as server:
        yield server, backend, tokenizer


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    """Two slots over a random model with no end tokens: every request makes all it asks for."""
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("serve-endless"))
    model = random_model(0, vocab_size=len(tokenizer), max_position_embeddings=512)
    engine = Engine(model, eos_ids=[], config=EngineConfig(slots=2, page_size=16, max_len=512, chunk=128,
                                                           prefill_lanes=2, segment=SEGMENT))
    backend = ModelBackend(engine, tokenizer, model_name="rand")
    with OpenAIServer(backend) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        client.chat.completions.create(model="rand", messages=CHAT_CONVERSATION, max_tokens=4)  # compiles
        yield server, backend, client


KW = dict(model="rand", messages=CHAT_CONVERSATION, temperature=1.0)


def test_streamed_text_arrives_while_the_request_is_still_generating(endless):
    _, backend, client = endless
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
    assert texts[0] < 0.5 * total, (texts[0], total)
    assert len({round(t, 3) for t in texts}) >= 5, arrivals
    # the streamed reply is the non-streamed one (same seed, same tokens)
    plain = client.chat.completions.create(max_tokens=LONG, seed=5, **KW).choices[0].message
    assert "".join(text for _, text, _ in arrivals) == (plain.content or "") + (
        (plain.model_extra or {}).get("reasoning_content") or "")
    print(f"first text {texts[0]:.3f} s of {total:.3f} s, {len(texts)} text chunks")


def test_a_client_that_leaves_frees_its_slot_within_one_segment(endless):
    _, backend, client = endless
    runner = backend.runner
    seen = []
    stream = client.chat.completions.create(max_tokens=LONG, seed=1, stream=True, **KW)
    for chunk in stream:
        seen.append(chunk)
        if any(c.delta.content for c in chunk.choices):
            break
    (rid,) = runner.history[-1][1]
    stream.close()  # the client leaves mid-generation
    left = runner.steps
    deadline = time.time() + 30
    while runner._thread is not None and time.time() < deadline:  # until the engine is idle
        time.sleep(0.005)
    # the request ran in at most two more steps (the one in flight when the client left, and
    # one while the server noticed), and the step after freed its slot
    last = max(step for step, ids in runner.history if rid in ids)
    print(f"client left after step {left}; the request last ran in step {last}")
    assert last <= left + 2, (left, last, list(runner.history)[-5:])
    assert backend.sampler.stats.generated_tokens < 10 * LONG
    assert not backend.sampler.running and sorted(backend.sampler._free_slots) == [0, 1]


def test_requests_join_and_leave_between_segments_with_their_own_tokens(endless):
    """A streams a long reply; once its text flows, B and C arrive: B takes the second slot
    beside A, C waits for a slot and joins when B leaves, A still running. Each gets exactly
    the tokens (and logprobs) it gets alone."""
    _, backend, client = endless
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
    # segment by segment, who ran: A alone, then A with B, then A with C (after B left)
    history = [ids for step, ids in backend.runner.history if step > step0 and ids]
    a = history[0][0]
    pairs = [ids for ids in history if len(ids) == 2]
    assert pairs and all(ids[0] == a for ids in pairs), history
    assert len({ids[1] for ids in pairs}) == 2, history  # B, then C in the second slot
    assert history[-1] == (a,) or history[-1][0] != a, history
