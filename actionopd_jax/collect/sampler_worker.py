"""The sampler worker: every state that is ready goes into ONE device call.

Trajectories put a request (prompt ids + the state's own PRNG key) on a bounded queue and
await its future. The worker takes everything that is ready -- after the first request it
keeps taking requests that arrive within `coalesce_s` of the previous one, for at most
`max_wait_s` (trajectories resuming from one burst of HTTP replies queue their states a few
milliseconds apart; one call for all of them beats one call for the first and another for
the rest) -- sorts it by prompt length (so
the sampler's chunks -- if a call exceeds the largest batch bucket -- hold similar lengths
and pad little), and runs the generate call in a single-thread executor: the device work
releases the GIL, so the event loop keeps serving teacher / judge / user-simulator HTTP
while the device is busy. Only one device call runs at a time.

Results never depend on the batching: each state brings its own key (derived from its
position in the run, see keys.py), and the sampler folds candidate indices into that key.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from actionopd_jax.sampling import Generation

# sample_fn(prompts, keys) -> per prompt, its N generations
SampleFn = Callable[[list[np.ndarray], list[jax.Array]], list[list[Generation]]]


@dataclass(frozen=True)
class SamplingSettings:
    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n ({self.n}) and max_new_tokens ({self.max_new_tokens}) must be >= 1")


def sampler_fn(sampler: Any, settings: SamplingSettings) -> SampleFn:
    """Adapt a `Sampler` (actionopd_jax.sampling) to the worker: one key per prompt."""

    def run(prompts: list[np.ndarray], keys: list[jax.Array]) -> list[list[Generation]]:
        result = sampler.sample(prompts, n=settings.n, max_new_tokens=settings.max_new_tokens,
                                temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                                key=list(keys))
        return result.generations

    return run


@dataclass
class _Request:
    prompt_ids: np.ndarray
    key: jax.Array
    future: asyncio.Future
    queued_at: float


@dataclass
class WorkerStats:
    calls: int = 0
    states: int = 0
    busy_s: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)


class SamplerError(RuntimeError):
    """The device call failed; every state in that call gets this error."""


class Versioned(list):
    """One state's N generations, with the oldest policy version whose weights they depend on
    (asynchronous collection stamps its groups with it, collect/async_scheduler.py)."""

    version: int = -1


class SamplerWorker:
    """Async front of a synchronous sample function. Use as `async with SamplerWorker(...)`."""

    def __init__(self, sample_fn: SampleFn, *, max_states_per_call: int = 64, max_queued: int = 1024,
                 coalesce_s: float = 0.005, max_wait_s: float = 0.05):
        if max_states_per_call < 1 or max_queued < 1:
            raise ValueError("max_states_per_call and max_queued must be >= 1")
        if coalesce_s < 0 or max_wait_s < 0:
            raise ValueError("coalesce_s and max_wait_s must be >= 0")
        self.sample_fn = sample_fn
        self.max_states_per_call = max_states_per_call
        self.coalesce_s = coalesce_s
        self.max_wait_s = max_wait_s
        self._queue: asyncio.Queue[_Request] = asyncio.Queue(maxsize=max_queued)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler")
        self._task: asyncio.Task | None = None
        self.stats = WorkerStats()

    async def __aenter__(self) -> "SamplerWorker":
        self._task = asyncio.create_task(self._run(), name="sampler-worker")
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        # A device call still running finishes in its thread; do not wait for it here.
        self._executor.shutdown(wait=False, cancel_futures=True)
        while not self._queue.empty():
            req = self._queue.get_nowait()
            if not req.future.done():
                req.future.cancel()

    async def sample(self, prompt_ids: np.ndarray, key: jax.Array, session: Any = None) -> list[Generation]:
        """The N generations for one state. Cancelling the awaiting task withdraws the
        request if the worker has not taken it yet. session (the trajectory): unused here,
        the engine worker's prefix statistics use it."""
        if self._task is None or self._task.done():
            raise RuntimeError("the sampler worker is not running (use `async with SamplerWorker(...)`)")
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(np.asarray(prompt_ids, np.int32), key, future, time.perf_counter()))
        return await future

    async def _take_ready(self, first: _Request) -> list[_Request]:
        loop = asyncio.get_running_loop()
        batch = [first]
        deadline = loop.time() + self.max_wait_s
        while len(batch) < self.max_states_per_call:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            remaining = deadline - loop.time()
            if self.coalesce_s <= 0 or remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), min(self.coalesce_s, remaining)))
            except asyncio.TimeoutError:
                break
        return [r for r in batch if not r.future.done()]  # drop withdrawn requests

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._take_ready(await self._queue.get())
            if not batch:
                continue
            batch.sort(key=lambda r: r.prompt_ids.size)
            prompts = [r.prompt_ids for r in batch]
            keys = [r.key for r in batch]
            t0 = time.perf_counter()
            try:
                generations = await loop.run_in_executor(self._executor, self.sample_fn, prompts, keys)
                if len(generations) != len(batch):
                    raise SamplerError(f"sample function returned {len(generations)} results for {len(batch)} prompts")
            except asyncio.CancelledError:
                for r in batch:
                    if not r.future.done():
                        r.future.cancel()
                raise
            except Exception as err:  # noqa: BLE001 - handed to every waiting state
                wrapped = err if isinstance(err, SamplerError) else SamplerError(f"{type(err).__name__}: {err}")
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(wrapped)
                continue
            finally:
                self.stats.busy_s += time.perf_counter() - t0
            self.stats.calls += 1
            self.stats.states += len(batch)
            self.stats.batch_sizes.append(len(batch))
            for r, gens in zip(batch, generations):
                if not r.future.done():
                    r.future.set_result(gens)
