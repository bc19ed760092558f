"""The engine's paged cache: a state's N samples share its prompt pages (pages counted), a
trajectory's next state prefills only its new tokens (tokens counted), a small pool evicts
without changing results, a weight update invalidates the cache, chat-template rewrites of
the history are counted, and a withdrawn request frees its slots at the next segment."""

import jax
import numpy as np
import pytest
from flax import nnx

from _engine_fixtures import EOS, SHAPES, assert_same, engine, reference
from _sampler_fixtures import random_model
from actionopd_jax.engine import Engine, EngineConfig

NEVER = [256, 257, 258, 259, 260]      # outside the vocabulary: rows run to max_new (same shape as EOS)
PAGE = SHAPES["page_size"]             # 4 tokens per page


def _prompt(seed, size):
    return np.random.default_rng(seed).integers(0, 256, size=size).astype(np.int32)


def _engine_never_stops(**overrides):
    from _engine_fixtures import model

    return Engine(model(), eos_ids=NEVER, lm_head="float32", config=EngineConfig(segment=3, **{**SHAPES, **overrides}))


def test_the_samples_of_a_state_share_its_prompt_pages():
    eng = _engine_never_stops()
    req = eng.submit(_prompt(0, 10), n=4, max_new_tokens=6, temperature=1.0, key=jax.random.key(1))
    eng.step()                                   # admitted, prefilled, first segment (3 tokens each)
    # prompt of 10 tokens: pages [0-3], [4-7] full and shared, [8-9] partial (sample 0's; the
    # others copy it). A slot holds 10 + 6 - 1 = 15 tokens = 4 pages, so each sample has one
    # page of its own beyond the prompt's: 2 shared + 1 partial + 1 + 3 x (1 copy + 1) = 10
    # pages, where 4 unshared slots would hold 16
    assert eng.pages.in_use == 10
    tables = eng.host["table"][req.slots][:, :4]
    assert (tables[:, :2] == tables[0, :2]).all()                  # shared full prompt pages
    assert len(set(tables[:, 2].tolist())) == 4                    # partial page: one per sample
    assert eng.pages.refs[tables[0, 0]] == 1                       # held once, by the request
    eng.run()
    assert eng.pages.in_use == 0
    # every full page of the 4 sequences (prompt + first 5 generated = 15 tokens: 3 full
    # pages each) is cached: 2 shared prompt pages + 4 x 1
    assert len(eng.pages.index.by_key) == 6


def test_a_trajectorys_next_state_prefills_only_its_new_tokens():
    eng = engine(3)
    prompt = _prompt(1, 10)
    first = eng.sample([prompt], n=1, max_new_tokens=7, temperature=0.0, key=jax.random.key(2)).generations[0][0]
    assert first.token_ids.size == 7 and first.finish_reason == "length"   # (seed chosen so it runs to the end)
    before = (eng.stats.prefilled_tokens, eng.stats.prefix_hit_tokens)
    nxt = np.concatenate([prompt, first.token_ids, _prompt(2, 5)])     # history + reply + tool result: 22 tokens
    got = eng.sample([nxt], n=2, max_new_tokens=8, temperature=1.0, key=[jax.random.key(3)])
    # cached: prompt + the reply's first 6 tokens (its last one was never fed) = 16 tokens = 4
    # full pages; prefilled: the other 6 of 22
    assert eng.stats.prefix_hit_tokens - before[1] == 16
    assert eng.stats.prefilled_tokens - before[0] == 6
    assert_same(got.generations, reference([nxt], [jax.random.key(3)], n=[2], max_new_tokens=[8],
                                           temperature=[1.0], top_p=[1.0], top_k=[0]))


def test_a_rewritten_history_is_counted_and_its_common_prefix_reused():
    eng = engine(3)
    prompt = _prompt(4, 10)
    eng.submit(prompt, n=1, max_new_tokens=4, key=jax.random.key(5), session="traj-1")
    eng.run()
    hits = eng.stats.prefix_hit_tokens
    # the template dropped something after token 6 (Qwen3 drops earlier reasoning): not the
    # previous prompt + reply
    rewritten = np.concatenate([prompt[:6], _prompt(6, 9)])
    eng.submit(rewritten, n=1, max_new_tokens=4, key=jax.random.key(6), session="traj-1")
    eng.run()
    assert (eng.stats.template_misses, eng.stats.template_miss_tokens) == (1, 10 - 6)
    assert eng.stats.prefix_hit_tokens - hits == PAGE           # the common 6 tokens: one full page


def test_a_small_pool_evicts_and_gives_the_same_samples():
    eng = engine(3)
    prompts = [_prompt(10 + i, 18 + i) for i in range(8)]
    keys = [jax.random.key(20 + i) for i in range(8)]
    settings = dict(n=[2] * 8, max_new_tokens=[20] * 8, temperature=[1.0] * 8, top_p=[1.0] * 8, top_k=[0] * 8)
    got = eng.sample(prompts, key=keys, **settings)
    assert eng.pages.stats.evictions > 0          # 47 usable pages; the cached sequences need more
    assert_same(got.generations, reference(prompts, keys, **settings))
    again = eng.sample(prompts[:2], key=keys[:2], **{k: v[:2] for k, v in settings.items()})
    assert_same(again.generations, got.generations[:2])


def test_a_weight_update_invalidates_the_prefix_cache():
    m = random_model(1)                           # own weights to update (same shapes: same programs)
    eng = Engine(m, eos_ids=EOS, lm_head="float32", config=EngineConfig(segment=3, **SHAPES))
    prompt = _prompt(30, 13)
    eng.sample([prompt], n=1, max_new_tokens=5, key=jax.random.key(7))
    assert len(eng.pages.index.by_key) > 0
    nnx.update(m, jax.tree.map(lambda x: x * 1.05, nnx.state(m, nnx.Param)))
    hits = eng.stats.prefix_hit_tokens
    got = eng.sample([prompt], n=1, max_new_tokens=5, key=jax.random.key(7))
    assert eng.pages.stats.invalidations == 1
    assert eng.stats.prefix_hit_tokens == hits     # nothing reused from the old weights' cache
    fresh = Engine(m, eos_ids=EOS, lm_head="float32", config=EngineConfig(segment=3, **SHAPES))
    assert_same(got.generations, fresh.sample([prompt], n=1, max_new_tokens=5, key=jax.random.key(7)).generations,
                atol=0)
    # an update while requests run is refused
    eng.submit(prompt, n=1, max_new_tokens=20, key=jax.random.key(8))
    eng.step()
    nnx.update(m, jax.tree.map(lambda x: x * 1.0, nnx.state(m, nnx.Param)))
    with pytest.raises(RuntimeError, match="weights changed while requests were running"):
        eng.step()


def test_a_withdrawn_request_frees_its_slots_at_the_next_segment():
    eng = _engine_never_stops()
    a = eng.submit(_prompt(40, 3), n=2, max_new_tokens=40, key=jax.random.key(9))
    eng.step()
    # b needs 1 + 10 + 3 x 11 = 44 pages; a holds 22 of the 47
    b = eng.submit(_prompt(41, 3), n=4, max_new_tokens=40, key=jax.random.key(10))
    eng.step()
    assert not b.slots and len(eng.running) == 2
    eng.cancel(a)
    eng.step()                                     # a leaves at the boundary, b is in this segment
    assert sorted(r.rid for r, _ in eng.running.values()) == [b.rid] * 4
    assert all(len(t) == 3 for t in b.tokens)
