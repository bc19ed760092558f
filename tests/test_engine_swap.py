"""New weights for a running engine (issue 44, engine/versions.py): a request running across a
swap finishes under the new weights with each token stamped by the version that sampled it, no
request after the swap reads a page of the old weights (prefix cache), and the engine worker
swaps on its own thread between steps while a state is decoding."""

import asyncio
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _engine_fixtures import SHAPES, assert_same, model
from actionopd_jax.engine import Engine, EngineConfig

NEVER = [256, 257, 258, 259, 260]      # outside the vocabulary: rows run to max_new (test_engine_cache's shape)


def _weights():
    graphdef, state = nnx.split(model())
    old = nnx.to_pure_dict(state)
    new = jax.tree.map(lambda x: x * 1.05 if jnp.issubdtype(x.dtype, jnp.floating) else x, old)
    return graphdef, old, new


def _engine(graphdef, params, version):
    eng = Engine(model(), eos_ids=NEVER, lm_head="float32", config=EngineConfig(segment=3, **SHAPES))
    eng.load_policy(graphdef, params, version=version)
    return eng


def _prompt(seed, size):
    return np.random.default_rng(seed).integers(0, 256, size=size).astype(np.int32)


def test_a_request_runs_on_across_a_swap_stamped_per_token_and_nothing_reads_the_old_pages():
    graphdef, old, new = _weights()
    eng = _engine(graphdef, old, 0)
    prompt = _prompt(60, 10)
    a = eng.submit(prompt, n=2, max_new_tokens=12, temperature=1.0, key=jax.random.key(1))
    eng.step()                                     # admitted, prefilled (its 2 full pages indexed), 3 tokens
    assert [len(t) for t in a.tokens] == [3, 3] and len(eng.pages.index.by_key) == 2
    held = list(a.prompt_pages)
    # the checks of the first load still hold mid-run, and a refused swap changes nothing
    bad = dict(new, norm={"scale": jnp.zeros(3)})
    with pytest.raises(ValueError):
        eng.load_policy(graphdef, bad, version=1)
    with pytest.raises(RuntimeError, match="another mesh"):
        eng.load_policy(graphdef, new, jax.make_mesh((1,), ("tensor",)), version=1)
    eng.load_policy(graphdef, new, version=1)      # rows running: the old engine refused this
    hits = eng.stats.prefix_hit_tokens
    b = eng.submit(prompt, n=1, max_new_tokens=8, temperature=1.0, key=jax.random.key(2))
    eng.step()
    assert eng.pages.stats.invalidations == 1
    assert (eng.pages.refs[held] > 0).all()        # the running rows still hold their pages
    eng.run()
    # a ran on to its end: tokens of the first segment sampled under version 0, the rest under 1
    assert all(len(t) == 12 for t in a.tokens) and a.version == 0 and a.oldest_version == 0
    for gen in a.generations:
        assert gen.versions.tolist() == [0] * 3 + [1] * 9
    assert b.version == 1 and b.oldest_version == 1 and b.generations[0].versions.tolist() == [1] * 8
    # b read nothing cached under the old weights, and a (admitted before the swap) left nothing
    # in the cache: c, which extends a's history, finds only b's prompt pages (2 pages, 8 tokens)
    assert eng.stats.prefix_hit_tokens == hits
    history = np.concatenate([prompt, np.asarray(a.tokens[0], np.int32)])
    c = eng.sample([history], n=1, max_new_tokens=8, temperature=1.0, key=[jax.random.key(3)])
    assert eng.stats.prefix_hit_tokens == hits + 8
    assert eng.pages.in_use == 0                    # every page released, none twice
    # b and c are exactly what an engine that only ever had the new weights samples
    fresh = _engine(graphdef, new, 1)
    assert_same([b.generations], fresh.sample([prompt], n=1, max_new_tokens=8, key=[jax.random.key(2)]).generations)
    assert_same(c.generations, fresh.sample([history], n=1, max_new_tokens=8, key=[jax.random.key(3)]).generations)


def _until(cond) -> None:
    while not cond():
        time.sleep(0.001)


def test_the_engine_worker_swaps_between_steps_while_a_state_decodes():
    from actionopd_jax.collect.engine_worker import EngineSampling, EngineWorker
    from actionopd_jax.collect.sampler_worker import SamplingSettings, WorkerStats

    graphdef, old, new = _weights()
    eng = _engine(graphdef, old, 0)
    settings = SamplingSettings(n=2, max_new_tokens=15, temperature=1.0, top_p=1.0, top_k=0)
    events, paused, go = [], threading.Event(), threading.Event()
    left_prompt = _prompt(63, 9)

    def left_decoding():   # `left`'s rows are in the engine with tokens sampled
        return any(np.array_equal(req.prompt, left_prompt) and any(req.tokens) for req, _ in eng.running.values())

    # the engine's thread waits after a step that makes the first of these true (then drops it):
    # after its second step, then once `left` decodes (not "the next step": after `second` ends
    # the worker may step once more before `left` is admitted)
    pause_when = [lambda: events.count("step") == 2]
    step = eng.step

    def gated_step(*args, **kwargs):
        out = step(*args, **kwargs)
        events.append("step")
        if pause_when and pause_when[0]():
            pause_when.pop(0)
            paused.set()
            assert go.wait(30)
            go.clear()
        return out

    eng.step = gated_step
    stats = WorkerStats()

    def load(version):
        events.append(f"load {version}")
        eng.load_policy(graphdef, new if version else old, version=version)

    async def main():
        loop = asyncio.get_running_loop()
        async with EngineWorker(EngineSampling(eng, settings), stats=stats) as worker:
            first = asyncio.create_task(worker.sample(_prompt(61, 9), jax.random.key(4)))
            await loop.run_in_executor(None, paused.wait)       # two segments of `first` done
            paused.clear()
            swap = loop.run_in_executor(None, worker.swap, lambda: load(1))
            await loop.run_in_executor(None, _until, lambda: not worker._inbox.empty())
            go.set()
            await swap                              # back: the engine holds the new weights
            first, second = await first, await worker.sample(_prompt(62, 9), jax.random.key(5))
            pause_when.append(left_decoding)
            left = asyncio.create_task(worker.sample(left_prompt, jax.random.key(6)))
            await loop.run_in_executor(None, paused.wait)       # `left` is decoding: stop the worker now
            worker._stop.set()
            go.set()
        return first, second, worker, left

    first, second, worker, left = asyncio.run(main())
    # the swap ran on the engine's thread once the step it waited for had ended
    assert events[:3] == ["step", "step", "load 1"]
    assert first.version == 0 and [g.versions.tolist() for g in first] == [[0] * 6 + [1] * 9] * 2
    assert second.version == 1 and all(g.versions.tolist() == [1] * 15 for g in second)
    assert stats.states == 2 and stats.calls >= 10
    # a state still in the engine when its worker stopped is withdrawn there: the next worker
    # steps the engine and must not hand it to the closed loop
    assert left.cancelled() and eng.running
    assert all(req.cancelled for req, _ in eng.running.values())
    # with no worker running, a swap loads at once; the next worker serves as usual
    assert worker.swap(lambda: load(2)) == 0.0 and eng.version == 2

    async def again():
        async with EngineWorker(EngineSampling(eng, settings), stats=stats) as worker:
            return await worker.sample(_prompt(64, 9), jax.random.key(7))

    third = asyncio.run(again())
    assert third.version == 2 and all(g.versions.tolist() == [2] * 15 for g in third)
    assert not eng.busy and eng.pages.in_use == 0
