"""The Sampler on a tiny random Qwen3: exactness against full forwards, keys, stops, compiles."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from actionopd_jax.sampling import Buckets, Sampler, decode
from tests._sampler_fixtures import next_token_logits, random_model

BUCKETS = Buckets(prompt_len=(16, 64), prompts=(1, 2, 4), samples=(1, 2, 4), max_new=(8, 16))
VOCAB = 256


@pytest.fixture(scope="module")
def model():
    return random_model(3, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def sampler(model):
    return Sampler(model, eos_ids=[], buckets=BUCKETS)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).astype(np.int32) for n in lengths]


def test_greedy_equals_step_by_step_argmax_of_full_forwards(model, sampler):
    """Four prompts of lengths 3..50 left-padded into one batch; each greedy continuation
    must be the argmax chain of cache-free forwards over prompt + tokens so far."""
    prompts = _prompts([3, 17, 50, 9])
    out = sampler.sample(prompts, n=1, max_new_tokens=14, temperature=0.0, key=jax.random.key(0))
    for prompt, (gen,) in zip(prompts, out.generations):
        assert gen.finish_reason == "length" and gen.token_ids.shape == (14,)
        logits = next_token_logits(model, prompt, gen.token_ids)
        np.testing.assert_array_equal(gen.token_ids, logits.argmax(-1))
        # greedy rows report the T=1 full-softmax logprob
        ref = jax.nn.log_softmax(jnp.asarray(logits), -1)[np.arange(14), gen.token_ids]
        np.testing.assert_allclose(gen.logprobs, ref, atol=2e-4, rtol=1e-4)
    # the continuation is not trivial (a degenerate model would repeat one token)
    assert len(set(out.generations[2][0].token_ids.tolist())) > 3


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 1.0), (1.3, 0, 0.9), (1.0, 0, 1.0)])
def test_logprobs_are_full_tempered_softmax_at_sampled_tokens(model, sampler, temperature, top_k, top_p):
    # 4 prompts, n=3, up to 16 new tokens: the buckets (and so the programs) of the tests below
    prompts = _prompts([5, 30, 12, 3], seed=1)
    out = sampler.sample(prompts, n=3, max_new_tokens=12, temperature=temperature, top_k=top_k,
                         top_p=top_p, key=jax.random.key(7))
    for prompt, gens in zip(prompts, out.generations):
        assert len(gens) == 3
        for gen in gens:
            logits = next_token_logits(model, prompt, gen.token_ids)
            full = np.asarray(jax.nn.log_softmax(jnp.asarray(logits) / temperature, -1))
            np.testing.assert_allclose(gen.logprobs, full[np.arange(len(gen.token_ids)), gen.token_ids],
                                       atol=2e-4, rtol=1e-4)
            if top_k:
                rank = (logits > logits[np.arange(len(gen.token_ids)), gen.token_ids][:, None]).sum(-1)
                assert (rank < top_k).all()
    # the n samples of one prompt differ (separate keys after one shared prefill)
    assert len({tuple(g.token_ids.tolist()) for g in out.generations[1]}) > 1


def test_same_key_same_samples_different_key_different(sampler):
    prompts = _prompts([6, 11, 20], seed=2)   # 4-prompt, 4-sample buckets: the programs above
    kw = dict(n=3, max_new_tokens=10, temperature=1.0, key=jax.random.key(42))
    a = sampler.sample(prompts, **kw)
    b = sampler.sample(prompts, **kw)
    c = sampler.sample(prompts, **{**kw, "key": jax.random.key(43)})
    ids = lambda r: [g.token_ids.tolist() for gens in r.generations for g in gens]
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


def test_per_prompt_keys_make_results_independent_of_batching(sampler):
    prompts = _prompts([6, 11, 20], seed=3)
    keys = [jax.random.key(100 + i) for i in range(3)]
    together = sampler.sample(prompts, n=3, max_new_tokens=10, temperature=1.0, key=keys)
    alone = sampler.sample(prompts[2:], n=3, max_new_tokens=10, temperature=1.0, key=keys[2:])
    assert [g.token_ids.tolist() for g in together.generations[2]] == \
           [g.token_ids.tolist() for g in alone.generations[0]]


def test_end_tokens_and_per_prompt_max_new(model, sampler):
    prompts = _prompts([4, 12, 25], seed=4)
    # the probe: the module's sampler (no end token, the same buckets), its programs already built
    probe = sampler.sample(prompts, max_new_tokens=16, temperature=0.0, key=jax.random.key(0))
    first_row = probe.generations[0][0].token_ids
    end = int(first_row[3])  # a token greedy decoding of prompt 0 produces at step 3
    stopping = Sampler(model, eos_ids=[end], buckets=BUCKETS)
    out = stopping.sample(prompts, max_new_tokens=[16, 16, 5], temperature=0.0, key=jax.random.key(0))
    for i, ((gen,), (ref,)) in enumerate(zip(out.generations, probe.generations)):
        limit = 5 if i == 2 else 16
        hits = np.flatnonzero(ref.token_ids[:limit] == end)
        if hits.size:  # stops at (and keeps) the first end token
            assert gen.finish_reason == "stop"
            np.testing.assert_array_equal(gen.token_ids, ref.token_ids[:hits[0] + 1])
        else:
            assert gen.finish_reason == "length"
            np.testing.assert_array_equal(gen.token_ids, ref.token_ids[:limit])
    assert out.generations[0][0].finish_reason == "stop" and len(out.generations[0][0].token_ids) <= 4
    assert len(out.generations[2][0].token_ids) <= 5


def test_early_exit_when_every_row_has_stopped(model, sampler):
    prompts = _prompts([20], seed=5)
    # greedy, so the rows agree; 1 prompt x 3 samples: the batching test's programs
    probe = sampler.sample(prompts, n=3, max_new_tokens=16, temperature=0.0, key=jax.random.key(0))
    end = int(probe.generations[0][0].token_ids[1])
    stopping = Sampler(model, eos_ids=[end], buckets=BUCKETS)
    out = stopping.sample(prompts, n=4, max_new_tokens=16, temperature=0.0, key=jax.random.key(0))
    assert all(len(g.token_ids) <= 2 and g.finish_reason == "stop" for g in out.generations[0])
    assert out.decode_steps <= 2  # the loop stopped, it did not run to the 16-token bucket


def test_generated_cache_blocks_change_nothing_but_the_work(model, sampler):
    """Decode in phases over a generated cache split at 3, 5 and 8 (blocks of 3, 2, 3 and 8
    slots; decode.attention_spans): greedy tokens are still the argmax chain of full
    forwards, sampled tokens and logprobs equal the one-block sampler's with the same keys,
    and rows that stop inside a phase or on its last slot stay stopped."""
    assert decode.attention_spans(16, (3, 5, 8)) == (3, 5, 8, 16)
    assert decode.attention_spans(16, (16, 32)) == (16,)
    assert decode.attention_spans(64, ()) == (64,)
    blocked = Sampler(model, eos_ids=[], buckets=dataclasses.replace(BUCKETS, attention_spans=(3, 5, 8)))
    prompts = _prompts([3, 17, 50, 9], seed=8)
    # greedy with n=3: the sampled call's shapes, so one program serves both calls
    out = blocked.sample(prompts, n=3, max_new_tokens=14, temperature=0.0, key=jax.random.key(0))
    for prompt, gens in zip(prompts, out.generations):
        for gen in gens:
            assert gen.token_ids.shape == (14,)
            np.testing.assert_array_equal(gen.token_ids, next_token_logits(model, prompt, gen.token_ids).argmax(-1))
    kw = dict(n=3, max_new_tokens=[16, 5, 8, 3], temperature=1.0, top_k=20, key=jax.random.key(3))
    a, b = blocked.sample(prompts, **kw), sampler.sample(prompts, **kw)
    for gens_a, gens_b in zip(a.generations, b.generations):
        for ga, gb in zip(gens_a, gens_b):
            np.testing.assert_array_equal(ga.token_ids, gb.token_ids)
            np.testing.assert_allclose(ga.logprobs, gb.logprobs, atol=1e-5)
    assert [len(g[0].token_ids) for g in a.generations] == [16, 5, 8, 3]
    # the phases really ran as separate loops: one top-level while per block
    programs = [p for k, p in blocked._programs.items() if k[0] == "decode"]
    loops = [re.findall(r' while\(.*op_name="jit\(decode\)/while"', p.as_text()) for p in programs]
    assert programs and all(len(found) == 4 for found in loops), [len(found) for found in loops]


@pytest.mark.parametrize("lm_head", ["checked", "float32"])
def test_accelerator_path_forced_on_cpu_gives_the_same_samples(model, sampler, lm_head):
    """The accelerator path (layers under lax.scan, stacked KV cache, one attention phase,
    the model's own head; decode.py), forced on CPU: greedy tokens are the argmax chain of
    full forwards, and sampled tokens and logprobs equal the CPU backend's with the same keys
    (rows stopping at different lengths included; the CPU backend's "checked" head reports
    logprobs with an approximate normaliser, ~2e-4, checked_head.py). The programs really differ: the scan
    path has no output-major matmul and a layer loop inside the decode loop."""
    scan = Sampler(model, eos_ids=[], buckets=BUCKETS, backend="accelerator", lm_head=lm_head)
    cpu = sampler if lm_head == "checked" else Sampler(model, eos_ids=[], buckets=BUCKETS, lm_head=lm_head)
    assert scan.backend == "accelerator" and cpu.backend == "cpu"
    prompts = _prompts([3, 17, 50, 9], seed=8)
    # every call n=3 and at most 16 new tokens: one program per sampler (settings are
    # arguments, not shapes); the module's CPU sampler has it already
    greedy = scan.sample(prompts, n=3, max_new_tokens=14, temperature=0.0, key=jax.random.key(0))
    for prompt, gens in zip(prompts, greedy.generations):
        for gen in gens:
            assert gen.token_ids.shape == (14,)
            np.testing.assert_array_equal(gen.token_ids, next_token_logits(model, prompt, gen.token_ids).argmax(-1))
    ref = cpu.sample(prompts, n=3, max_new_tokens=14, temperature=0.0, key=jax.random.key(0))
    for kw in (dict(n=3, max_new_tokens=[16, 5, 8, 3], temperature=1.0, top_k=20, key=jax.random.key(3)),
               dict(n=3, max_new_tokens=12, temperature=0.8, top_p=0.9, key=jax.random.key(5))):
        got, want = scan.sample(prompts, **kw), cpu.sample(prompts, **kw)
        for gens_a, gens_b in zip(got.generations + greedy.generations, want.generations + ref.generations):
            for a, b in zip(gens_a, gens_b):
                np.testing.assert_array_equal(a.token_ids, b.token_ids)
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5 if lm_head == "float32" else 1e-3)
        assert [len(g[0].token_ids) for g in got.generations] == [len(g[0].token_ids) for g in want.generations]
    programs = [p.as_text() for k, p in scan._programs.items() if k[0] == "decode"]
    assert programs
    for text in programs:
        assert "rk,nk->rn" not in text                        # the modules' own weights
        assert len(re.findall(r" while\(", text)) >= 2        # decode loop + layer scan
    assert scan._checked is None                              # no "checked" head off the CPU backend


def test_backend_follows_the_target_platform():
    """The backend is chosen from the target (the mesh's devices while tracing under it),
    never from the host's default backend alone."""
    assert decode.resolve_backend("auto", "tpu") == "accelerator"
    assert decode.resolve_backend("auto", "gpu") == "accelerator"
    assert decode.resolve_backend("auto", "cpu") == "cpu"
    assert decode.resolve_backend("accelerator", "cpu") == "accelerator"
    assert decode.resolve_backend() == "cpu"       # tests run on CPU, no mesh
    with pytest.raises(ValueError, match="backend"):
        decode.resolve_backend("gpu")


def test_sampling_settings_do_not_recompile_and_buckets_bound_programs(model):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    sampler = Sampler(model, eos_ids=[1], buckets=BUCKETS)
    prompts = _prompts([5, 9, 14], seed=6)
    sampler.sample(prompts, n=2, max_new_tokens=8, temperature=0.6, top_k=20, top_p=0.95, key=jax.random.key(0))
    programs, backend_compiles = sampler.compile_count, len(compiles)
    assert programs == 2  # one prefill + one decode
    for i, (t, k, p) in enumerate([(0.0, 0, 1.0), (1.5, 3, 0.5), (0.9, 0, 0.8), (0.3, 200, 1.0)]):
        sampler.sample(prompts, n=2, max_new_tokens=[8, 3, 5], temperature=t, top_k=k, top_p=p,
                       key=jax.random.key(i))
    assert sampler.compile_count == programs
    assert len(compiles) == backend_compiles  # nothing compiled behind the sampler's back either
    # mixed lengths inside the same buckets reuse the same two programs
    sampler.sample(_prompts([2, 16, 11, 3], seed=7), n=[1, 2, 1, 2], max_new_tokens=6, temperature=1.0,
                   key=jax.random.key(9))
    assert sampler.compile_count == programs


def test_bad_input_is_rejected_with_a_clear_message(sampler):
    with pytest.raises(ValueError, match="token ids outside"):
        sampler.sample([np.array([1, VOCAB], np.int32)], max_new_tokens=4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="top_p"):
        sampler.sample(_prompts([3]), max_new_tokens=4, top_p=0.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="context"):
        sampler.sample(_prompts([3]), max_new_tokens=10_000, key=jax.random.key(0))
    with pytest.raises(TypeError, match="key"):
        sampler.sample(_prompts([3]), max_new_tokens=4, key=5)
    with pytest.raises(TypeError):
        sampler.sample(_prompts([3]), max_new_tokens=4)  # no default key


def test_bfloat16_model_samples():
    """bf16 parameters and compute: the decode path runs in bf16 and stays close to the
    model's own full forward (logprobs within bf16 noise, greedy tokens mostly agree)."""
    model = random_model(8, vocab_size=VOCAB, dtype="bfloat16")
    prompts = _prompts([5, 20], seed=8)
    out = Sampler(model, eos_ids=[], buckets=BUCKETS).sample(prompts, max_new_tokens=8, temperature=0.0,
                                                              key=jax.random.key(0))
    agree = []
    for prompt, (gen,) in zip(prompts, out.generations):
        assert gen.token_ids.shape == (8,) and np.isfinite(gen.logprobs).all()
        logits = next_token_logits(model, prompt, gen.token_ids).astype(np.float32)
        ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))[np.arange(8), gen.token_ids]
        np.testing.assert_allclose(gen.logprobs, ref, atol=0.1)
        agree.append((logits.argmax(-1) == gen.token_ids).mean())
    assert np.mean(agree) >= 0.75


@nnx.jit
def _full_hidden(model, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model(tokens, positions)[0]


def test_bfloat16_lm_head_is_an_explicit_opt_in(model, sampler):
    """Sampler(lm_head="bfloat16") samples from the head rounded to bf16 (hidden and
    weights, float32 accumulation): its greedy tokens and logprobs follow those rounded
    logits. The default sampler keeps the float32 model's choices ("checked")."""
    assert sampler.lm_head == "checked"
    with pytest.raises(ValueError, match="lm_head"):
        Sampler(model, eos_ids=[], lm_head="float16")
    prompts = _prompts([4, 19], seed=11)
    out = Sampler(model, eos_ids=[], buckets=BUCKETS, lm_head="bfloat16").sample(
        prompts, max_new_tokens=8, temperature=0.0, key=jax.random.key(0))
    w = (model.embed_tokens if model.lm_head is None else model.lm_head)[...].astype(jnp.bfloat16)
    agree = []
    for prompt, (gen,) in zip(prompts, out.generations):
        seq = np.concatenate([prompt, gen.token_ids]).astype(np.int32)[None, :-1]
        hidden = _full_hidden(model, jnp.asarray(seq))[0, prompt.size - 1:]
        rounded = jnp.einsum("td,vd->tv", hidden.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
        ref = np.asarray(jax.nn.log_softmax(rounded, -1))[np.arange(8), gen.token_ids]
        np.testing.assert_allclose(gen.logprobs, ref, atol=5e-3)
        agree.append((np.asarray(rounded).argmax(-1) == gen.token_ids).mean())
    assert np.mean(agree) >= 0.9
