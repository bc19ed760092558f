"""The accelerator path's prefill goes through `Qwen3.prefill_kv` (the fused causal attention of
`model.runtime.attention`), never the cached forward's dense [T, S] scores; tokens stay those of the
CPU backend (which keeps the cached forward)."""

import jax
import numpy as np
import pytest

from actionopd_jax.sampling import Buckets, Sampler, decode
from tests._sampler_fixtures import random_model

VOCAB = 256


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).astype(np.int32) for n in lengths]


def _same(a, b, atol):
    for gens_a, gens_b in zip(a.generations, b.generations):
        for x, y in zip(gens_a, gens_b):
            np.testing.assert_array_equal(x.token_ids, y.token_ids)
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=atol)


def test_right_align_moves_real_tokens_to_the_front():
    tokens = np.array([[0, 0, 5, 6], [1, 2, 3, 4], [0, 0, 0, 9]], np.int32)
    mask = tokens > 0
    t, m = decode.right_align(tokens, mask)
    np.testing.assert_array_equal(np.asarray(t), [[5, 6, 0, 0], [1, 2, 3, 4], [9, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(m), [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])


def test_prefill_layout_follows_the_attention_kernel():
    rt = random_model(0, vocab_size=VOCAB).runtime
    assert decode.prefill_layout(rt) == "left"                        # CPU: blocked path
    assert decode.prefill_layout(rt, "gpu") == "right"                 # auto = cuDNN on GPU
    assert decode.prefill_layout(rt.replace(attention="xla"), "gpu") == "left"
    assert decode.prefill_layout(rt, "tpu") == "left"                  # splash: any layout


@pytest.mark.parametrize("layout", ["left", "right"])
def test_prefill_kv_path_gives_the_cpu_backend_tokens(monkeypatch, layout):
    """Forced on CPU ("auto" attention = the blocked CPU kernel), both prompt layouts (right:
    what cuDNN needs on GPU) give the CPU backend's greedy and seeded samples."""
    model = random_model(3, vocab_size=VOCAB)
    buckets = Buckets(prompt_len=(16, 64), prompts=(1, 2, 4), samples=(1, 2, 4), max_new=(8, 16))
    monkeypatch.setattr(decode, "prefill_layout", lambda runtime, platform=None: layout)
    acc = Sampler(model, eos_ids=[], buckets=buckets, backend="accelerator", lm_head="float32")
    cpu = Sampler(model, eos_ids=[], buckets=buckets, lm_head="float32")
    prompts = _prompts([3, 17, 50, 9], seed=8)
    for kw in (dict(n=1, max_new_tokens=14, temperature=0.0, key=jax.random.key(0)),
               dict(n=3, max_new_tokens=[16, 5, 8, 3], temperature=1.0, top_k=20, key=jax.random.key(3))):
        _same(acc.sample(prompts, **kw), cpu.sample(prompts, **kw), atol=1e-5)


def test_prefill_kv_path_with_splash_interpret_gives_the_same_tokens():
    """attention="splash" (Pallas, interpret mode on CPU) in the accelerator path's prefill:
    the CPU backend's tokens on a tiny model (128-token prompt bucket: splash tiles)."""
    model = random_model(3, vocab_size=VOCAB)
    buckets = Buckets(prompt_len=(128,), prompts=(2,), samples=(2,), max_new=(8,))
    cpu = Sampler(model, eos_ids=[], buckets=buckets, lm_head="float32")
    model.runtime = model.runtime.replace(attention="splash")
    try:
        acc = Sampler(model, eos_ids=[], buckets=buckets, backend="accelerator", lm_head="float32")
        prompts = _prompts([40, 97], seed=2)
        kw = dict(n=2, max_new_tokens=8, temperature=1.0, key=jax.random.key(1))
        got = acc.sample(prompts, **kw)
    finally:
        model.runtime = model.runtime.replace(attention="auto")
    _same(got, cpu.sample(prompts, **kw), atol=1e-4)
