"""The sampler worker on its own: ready states share one call, late arrivals within the
coalescing window join it, withdrawn states are skipped, a failed device call fails every
state of that call (and only those), and results never depend on the batching."""

import asyncio
import threading
import time

import jax
import numpy as np
import pytest

from actionopd_jax.collect import SamplerError, SamplerWorker
from actionopd_jax.sampling import Generation


class RecordingSampleFn:
    """A stand-in for the device call (no model needed to test scheduling): each prompt's
    'generation' is derived from its ids and key only, and each call is recorded."""

    def __init__(self, delay_s=0.05, fail_on=None):
        self.calls: list[list[int]] = []
        self.threads: set[str] = set()
        self.delay_s, self.fail_on = delay_s, fail_on

    def __call__(self, prompts, keys):
        self.calls.append([int(p[0]) for p in prompts])
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)  # the event loop must keep running meanwhile
        if self.fail_on is not None and any(int(p[0]) == self.fail_on for p in prompts):
            raise RuntimeError("device out of memory (injected)")
        out = []
        for p, k in zip(prompts, keys):
            seed = int(np.asarray(jax.random.key_data(k))[-1])
            out.append([Generation(np.array([int(p[0]), seed % 97], np.int32), np.zeros(2, np.float32), "stop")])
        return out


def test_ready_states_share_a_call_and_late_ones_join_within_the_window():
    fn = RecordingSampleFn()
    keys = [jax.random.key(i) for i in range(6)]  # made up front: jax's first dispatch is slow
    fn([np.array([9])], [keys[0]])
    fn.calls.clear()
    fn.threads.clear()

    async def main():
        async with SamplerWorker(fn, max_states_per_call=16, coalesce_s=0.02, max_wait_s=0.2) as worker:
            async def state(i, delay):
                await asyncio.sleep(delay)
                return await worker.sample(np.array([i, 1, 2]), keys[i])

            ticks = []

            async def ticker():  # proves the loop is not blocked by the device call
                for _ in range(8):
                    ticks.append(time.perf_counter())
                    await asyncio.sleep(0.01)

            results = await asyncio.gather(*(state(i, 0.005 * i) for i in range(6)), ticker())
            return results[:6], ticks, worker.stats

    results, ticks, stats = asyncio.run(main())
    assert fn.calls == [[0, 1, 2, 3, 4, 5]]  # 5 ms apart, inside the 20 ms window: one call
    assert stats.calls == 1 and stats.states == 6 and stats.busy_s >= 0.05
    assert all(r[0].token_ids[0] == i for i, r in enumerate(results))
    assert max(np.diff(ticks)) < 0.045  # the loop kept ticking during the 50 ms call
    assert all(name.startswith("sampler") for name in fn.threads)


def test_max_states_per_call_and_no_coalescing():
    fn = RecordingSampleFn(delay_s=0.0)

    async def main():
        async with SamplerWorker(fn, max_states_per_call=3, coalesce_s=0.0) as worker:
            return await asyncio.gather(*(worker.sample(np.array([i]), jax.random.key(i)) for i in range(7)))

    asyncio.run(main())
    assert [len(c) for c in fn.calls] == [3, 3, 1]
    assert sorted(sum(fn.calls, [])) == list(range(7))


def test_results_do_not_depend_on_batching():
    async def run(per_call):
        fn = RecordingSampleFn(delay_s=0.0)
        async with SamplerWorker(fn, max_states_per_call=per_call, coalesce_s=0.0) as worker:
            res = await asyncio.gather(*(worker.sample(np.array([i]), jax.random.key(100 + i)) for i in range(5)))
        return [r[0].token_ids.tolist() for r in res], fn.calls

    one_by_one, calls_a = asyncio.run(run(1))
    together, calls_b = asyncio.run(run(5))
    assert len(calls_a) == 5 and len(calls_b) == 1
    assert one_by_one == together


def test_withdrawn_states_are_skipped_and_failures_reach_only_their_call():
    fn = RecordingSampleFn(delay_s=0.05, fail_on=2)

    async def main():
        async with SamplerWorker(fn, max_states_per_call=2, coalesce_s=0.0) as worker:
            first = asyncio.create_task(worker.sample(np.array([0]), jax.random.key(0)))
            await asyncio.sleep(0)  # the worker takes state 0 alone
            withdrawn = asyncio.create_task(worker.sample(np.array([1]), jax.random.key(1)))
            failing = asyncio.create_task(worker.sample(np.array([2]), jax.random.key(2)))
            await asyncio.sleep(0.01)
            withdrawn.cancel()
            ok = await first
            with pytest.raises(SamplerError, match="out of memory"):
                await failing
            after = await worker.sample(np.array([3]), jax.random.key(3))  # the worker survives a failed call
            return ok, after

    ok, after = asyncio.run(main())
    assert ok[0].token_ids[0] == 0 and after[0].token_ids[0] == 3
    assert [1] not in fn.calls and [1, 2] not in fn.calls and [2] in fn.calls


def test_sample_without_running_worker_is_a_clear_error():
    worker = SamplerWorker(RecordingSampleFn())

    async def main():
        await worker.sample(np.array([0]), jax.random.key(0))

    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(main())
