"""The asynchronous schedule of issue 44 (collect.max_staleness = eta >= 1): the collector's
trajectories run on an event loop of their own, on a background thread, across trainer steps.

- Work is admitted by draws: draw d is the task starts of trainer step d, taken from the task
  stream in the same order as the synchronous loop takes them. The source admits draws up to
  step + eta at each step's collect, so in-flight plus finished-but-untrained trajectories never
  pass (eta + 1) steps of task starts (admission control, as SkyRL's and AReaL's).
- A fixed pool of runners (collect.concurrency) takes the admitted task starts in order, oldest
  draw first, and runs the collector's own trajectory code (collector.py) with the draw's step
  for its keys: a draw's random choices do not depend on when it ran.
- New weights reach the sampler between device calls (`VersionedSampling.swap`, the static
  sampler) or between engine steps (`EngineVersions.swap`, collect.sampler = "engine": the
  loop's worker is then an `EngineWorker`, and rows in flight carry on under the new weights,
  every token stamped with its weights' version, engine/versions.py): running trajectories are
  not drained, and every state's generations carry the version (trainer step) of the oldest
  weights they depend on, which `AsyncCollector` stamps on the state's group
  (`StateGroup.policy_version`).
- A systemic failure (a budget stop, a failed device call) is handed to the step that waits;
  the source then stops the loop: a budget stop lets the trajectories in flight reach their next
  paid request (so paid answers land in the teacher cache), anything else cancels them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from actionopd_jax.collect.collector import Collector, aclose_clients
from actionopd_jax.collect.group import GroupOutcome
from actionopd_jax.collect.metrics import TrajectoryRecord
from actionopd_jax.collect.engine_worker import EngineSampling, EngineWorker
from actionopd_jax.collect.sampler_worker import SamplerWorker, Versioned, WorkerStats
from actionopd_jax.paid_calls import BudgetReached
from actionopd_jax.types import StateGroup, Task


class VersionedSampling:
    """A sample function (sampler_worker.SampleFn) whose weights are swapped between device
    calls: the swap waits for the call that is running, never interrupts it."""

    def __init__(self, sample_fn: Callable):
        self.sample_fn = sample_fn
        self.version = -1
        self._lock = threading.Lock()
        self.busy_s = 0.0   # seconds inside device calls (the sampler's busy fraction)

    def __call__(self, prompts, keys):
        with self._lock:
            version = self.version
            t0 = time.perf_counter()
            try:
                generations = self.sample_fn(prompts, keys)
            finally:
                self.busy_s += time.perf_counter() - t0
        out = []
        for gens in generations:
            v = Versioned(gens)
            v.version = version
            out.append(v)
        return out

    def swap(self, load: Callable[[], None], version: int) -> float:
        """Run `load` (the sampler's load_policy) between device calls and stamp what follows
        with `version`; returns the seconds it waited for a running call to end."""
        t0 = time.perf_counter()
        with self._lock:
            waited = time.perf_counter() - t0
            load()
            self.version = int(version)
        return waited


class EngineVersions:
    """`VersionedSampling`'s counterpart for the engine: the swap goes through the loop's
    `EngineWorker` (its thread loads the weights between two steps; `load(version=...)` stamps
    them), or runs at once where no worker runs (the first step, a stopped loop). `stats`: the
    workers' counters across loop restarts (busy seconds, calls, states)."""

    def __init__(self, worker: Callable[[], EngineWorker | None]):
        self._worker = worker
        self.stats = WorkerStats()

    @property
    def busy_s(self) -> float:
        return self.stats.busy_s

    def swap(self, load: Callable[..., None], version: int) -> float:
        worker = self._worker()
        stamped = lambda: load(version=int(version))  # noqa: E731
        if worker is None:
            stamped()
            return 0.0
        return worker.swap(stamped)


class AsyncCollector(Collector):
    """The collector whose groups record the policy version of their generations, and which
    counts the teacher requests in flight. `close()` stops the scheduler's loop first."""

    scheduler: "AsyncScheduler | None" = None
    teacher_in_flight = 0

    async def group_outcome(self, task, start, step, decision, prompt, generations, batch, rec, env=None
                            ) -> GroupOutcome:
        outcome = await super().group_outcome(task, start, step, decision, prompt, generations, batch, rec, env=env)
        if outcome.group is not None:
            outcome.group.policy_version = int(getattr(generations, "version", -1))
        return outcome

    async def _teacher_samples(self, task, prompt, rec):
        self.teacher_in_flight += 1
        try:
            return await super()._teacher_samples(task, prompt, rec)
        finally:
            self.teacher_in_flight -= 1

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        super().close()


@dataclass
class Draw:
    """One trainer step's task starts (this process's share) and what they produced."""

    step: int
    starts: list[tuple[int, Task]]
    records: list[TrajectoryRecord] = field(default_factory=list)
    outcomes: list[tuple[int, StateGroup, np.ndarray | None]] = field(default_factory=list)
    remaining: int = 0
    done: asyncio.Event | None = None


class AsyncScheduler:
    """The background event loop and its runners. Main-thread API: start, admit, wait, stop."""

    def __init__(self, collector: AsyncCollector, *, concurrency: int, worker_kwargs: dict[str, Any]):
        """worker_kwargs: the SamplerWorker's, or the EngineWorker's where the collector's
        sample_fn is an `EngineSampling`."""
        self.collector = collector
        self.concurrency = max(int(concurrency), 1)
        self.worker_kwargs = worker_kwargs
        self.worker: SamplerWorker | EngineWorker | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draws: dict[int, Draw] = {}
        self._fatal: BaseException | None = None
        self._drain = False
        self.running_trajectories = 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the loop (a no-op while it runs)."""
        if self.running:
            return
        self._fatal, self._drain, self._draws = None, False, {}
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(ready,), name="async-collect", daemon=True)
        self._thread.start()
        ready.wait()
        if not self.running:
            raise RuntimeError(f"the asynchronous collection loop did not start: {self._fatal!r}")

    def admit(self, step: int, starts: Sequence[tuple[int, Task]]) -> None:
        self._call(self._admit(Draw(step=step, starts=list(starts))))

    def wait(self, step: int) -> Draw:
        """Block until draw `step` has finished; raises the loop's systemic failure (then the
        loop is stopped) instead."""
        draw = self._call(self._wait(step))
        if draw is None:
            fatal = self._fatal
            self.stop(drain=isinstance(fatal, BudgetReached))
            raise fatal
        return draw

    def stop(self, drain: bool = False) -> None:
        """Stop the loop and join its thread. drain: let the trajectories in flight run on until
        they stop by themselves (after a budget stop: at their next paid request); else cancel."""
        if self._thread is None:
            return
        if self.running:
            self._loop.call_soon_threadsafe(self._begin_stop, drain)
        self._thread.join()
        self._thread = None

    # --- the loop's thread ---------------------------------------------------------------------
    def _call(self, coro):
        if not self.running:
            coro.close()
            raise RuntimeError("the asynchronous collection loop is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _thread_main(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve(ready))
        except BaseException as err:  # noqa: BLE001 - kept for the caller; the thread ends cleanly
            self._fatal = self._fatal or err
        finally:
            ready.set()
            # the HTTP clients were made on this loop: closed here, before the loop is
            self._loop.run_until_complete(aclose_clients(self.collector.teacher, self.collector.matcher))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _serve(self, ready: threading.Event) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._stopping = asyncio.Event()
        sample_fn = self.collector.sample_fn
        kind = EngineWorker if isinstance(sample_fn, EngineSampling) else SamplerWorker
        async with kind(sample_fn, **self.worker_kwargs) as worker:
            self.worker = worker
            runners = [asyncio.create_task(self._runner(worker)) for _ in range(self.concurrency)]
            ready.set()
            await self._stopping.wait()
            if not self._drain:
                for r in runners:
                    r.cancel()
            for _ in runners:   # wake idle runners: each takes one item, sees the stop, returns
                self._queue.put_nowait(None)
            await asyncio.gather(*runners, return_exceptions=True)

    def _begin_stop(self, drain: bool) -> None:
        self._drain = drain
        self._stopping.set()

    async def _admit(self, draw: Draw) -> None:
        draw.done = asyncio.Event()
        draw.remaining = len(draw.starts)
        self._draws[draw.step] = draw
        for start, task in draw.starts:
            self._queue.put_nowait((draw, start, task))
        if not draw.remaining or self._fatal is not None:
            draw.done.set()

    async def _wait(self, step: int) -> Draw | None:
        draw = self._draws.get(step)
        if draw is None:
            raise RuntimeError(f"draw {step} was never admitted (admitted: {sorted(self._draws)})")
        await draw.done.wait()
        if self._fatal is not None:
            return None
        del self._draws[step]
        return draw

    def _fail(self, err: BaseException) -> None:
        if self._fatal is None:
            self._fatal = err
        for draw in self._draws.values():
            draw.done.set()

    async def _runner(self, worker: SamplerWorker | EngineWorker) -> None:
        while True:
            item = await self._queue.get()
            if item is None or self._stopping.is_set() or self._fatal is not None:
                return
            draw, start, task = item
            self.running_trajectories += 1
            try:
                rec, groups = await self.collector._trajectory(start, task, draw.step, worker)
            except asyncio.CancelledError:
                raise
            except BaseException as err:  # noqa: BLE001 - systemic (budget, device): the run stops
                self._fail(err)
                return
            finally:
                self.running_trajectories -= 1
            draw.records.append(rec)
            draw.outcomes.extend((start, g, c) for g, c in groups)
            draw.remaining -= 1
            if draw.remaining == 0:
                draw.done.set()


__all__ = ["AsyncCollector", "AsyncScheduler", "Draw", "EngineVersions", "Versioned", "VersionedSampling"]
