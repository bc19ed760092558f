"""Server limits: a client that disconnects stops holding the device, and a --max-context the
model cannot take is refused at start-up (not answered with a 500 per request)."""

import asyncio
import os
import subprocess
import sys
import time

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
