"""The collector's engine worker (collect.sampler = "engine"): states submitted as they become
ready get the static sampler's samples, a short state comes back while a longer one submitted
before it is still decoding, a withdrawn state leaves the engine, and the config builds it."""

import asyncio
import time

import jax
import numpy as np
import pytest

from _engine_fixtures import assert_same, engine, reference
from actionopd_jax.collect.engine_worker import EngineSampling, EngineWorker
from actionopd_jax.collect.sampler_worker import SamplingSettings


def test_states_as_they_come_get_the_static_samples_and_return_when_their_rows_end():
    settings = SamplingSettings(n=2, max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=0)
    eng = engine(3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=int(rng.integers(3, 20))).astype(np.int32) for _ in range(5)]
    keys = [jax.random.key(50 + i) for i in range(5)]
    want = reference(prompts, keys, n=[2] * 5, max_new_tokens=[24] * 5, temperature=[1.0] * 5, top_p=[1.0] * 5,
                     top_k=[0] * 5)

    async def main():
        async with EngineWorker(EngineSampling(eng, settings)) as worker:
            async def state(i):
                await asyncio.sleep(0.03 * i)           # trajectories become ready at different times
                return await worker.sample(prompts[i], keys[i])
            return await asyncio.gather(*(state(i) for i in range(5))), worker.stats

    got, stats = asyncio.run(main())
    assert_same(got, want)
    assert stats.states == 5 and not eng.busy


def test_a_short_state_is_back_before_a_long_one_ends_and_withdrawal_frees_it():
    settings = SamplingSettings(n=1, max_new_tokens=45, temperature=1.0, top_p=1.0, top_k=0)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, size=6).astype(np.int32) for _ in range(6)]
    keys = [jax.random.key(70 + i) for i in range(6)]
    want = reference(prompts, keys, n=[1] * 6, max_new_tokens=[45] * 6, temperature=[1.0] * 6, top_p=[1.0] * 6,
                     top_k=[0] * 6)
    lengths = [w[0].token_ids.size for w in want]
    long, short = int(np.argmax(lengths)), int(np.argmin(lengths))
    assert lengths[long] >= lengths[short] + 12      # (seed chosen for a clear gap)
    # withdrawn once the short state is back: a state that is still decoding then
    gone = next(i for i in range(6) if i not in (long, short) and lengths[i] >= lengths[short] + 6)
    eng = engine(3)

    async def main():
        async with EngineWorker(EngineSampling(eng, settings)) as worker:
            done_at = {}

            async def state(i, delay):
                await asyncio.sleep(delay)
                gens = await worker.sample(prompts[i], keys[i])
                done_at[i] = time.perf_counter()
                return gens

            tasks = [asyncio.create_task(state(i, 0)) for i in (long, gone, short)]
            got_short = await tasks[2]
            tasks[1].cancel()                            # a trajectory given up on: withdrawn
            got_long = await tasks[0]
            return got_long, got_short, done_at, tasks[1]

    got_long, got_short, done_at, withdrawn = asyncio.run(main())
    assert_same([got_long, got_short], [want[long], want[short]])
    assert done_at[short] < done_at[long]            # back as soon as its own row ended
    assert withdrawn.cancelled() and gone not in done_at
    assert not eng.busy and eng.pages.in_use == 0


def test_collect_sampler_engine_builds_the_engine_from_the_config():
    from actionopd_jax.collect.source import build_engine
    from actionopd_jax.config.load import from_dict
    from actionopd_jax.testing.tiny_checkpoint import tiny_config

    cfg = from_dict({"collect": {"sampler": "engine", "concurrency": 3, "num_candidates": 2, "engine_segment": 5,
                                 "max_prompt_tokens": 100, "max_response_tokens": 28}})
    eng = build_engine(cfg, tiny_config(), eos=7)
    assert (eng.config.slots, eng.config.segment, eng.config.max_len) == (6, 5, 128)
    assert eng.model is None
    # the pool is sized at the first load_policy (on the rollout mesh, weights resident), keeping
    # room for an update's gradients and activations
    assert eng.total_pages is None and eng.reserve_bytes > 0
    with pytest.raises(RuntimeError, match="load_policy"):
        eng.submit(np.arange(5, dtype=np.int32), max_new_tokens=3, key=jax.random.key(0))
