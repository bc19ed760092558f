"""The engine worker: each state goes into the continuous-batching engine when it is ready and
comes back as soon as its own N samples are done (collect.sampler = "engine").

The `SamplerWorker` interface (async context manager, `await sample(prompt_ids, key)`,
`stats`), so the collector runs either. One thread owns the engine: it takes submissions from
a thread-safe queue between scheduler steps and steps while anything is in flight; results are
handed to the event loop with `call_soon_threadsafe`, so teacher / judge / user-simulator HTTP
keeps running while the device works. Results do not depend on arrival order (each state
brings its own key; engine.py).

New weights go through the same queue (`swap`): the engine's thread loads them between two
steps, while rows run on (engine/versions.py), and each state comes back as a `Versioned` list
stamped with the oldest weights' version it depends on (asynchronous collection, issue 44).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from actionopd_jax.collect.sampler_worker import SamplerError, SamplingSettings, Versioned, WorkerStats
from actionopd_jax.sampling import Generation




@dataclass(frozen=True)
class EngineSampling:
    """An engine and the collector's sampling settings: what the collector runs an
    `EngineWorker` over (the engine counterpart of `sampler_worker.sampler_fn`)."""

    engine: Any
    settings: SamplingSettings


class EngineWorker:
    """Async front of an `Engine`. Use as `async with EngineWorker(EngineSampling(...))`.
    stats: counters to add to (one object across the workers of a run); default a new one."""

    def __init__(self, sampling: EngineSampling, *, idle_poll_s: float = 0.05, stats: WorkerStats | None = None):
        self.engine = sampling.engine
        self.settings = sampling.settings
        self.idle_poll_s = idle_poll_s
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._futures: dict[int, tuple[asyncio.Future, Any]] = {}     # request id -> (its awaiting future, request)
        self.stats = stats if stats is not None else WorkerStats()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def __aenter__(self) -> "EngineWorker":
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._serve, name="engine", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        for future, request in self._futures.values():
            # withdrawn from the engine too: a later worker steps it, and must not finish a
            # request whose caller (this worker's loop) is gone
            self.engine.cancel(request)
            if not future.done():
                future.cancel()
        self._futures.clear()

    async def sample(self, prompt_ids: np.ndarray, key: jax.Array, session: Any = None) -> list[Generation]:
        """The N generations for one state; cancelling the await withdraws it from the engine.
        session: the trajectory, so the engine counts chat-template misses of its history."""
        if not self.running:
            raise RuntimeError("the engine worker is not running (use `async with EngineWorker(...)`)")
        future = self._loop.create_future()
        holder: dict[str, Any] = {}
        self._inbox.put(("submit", np.asarray(prompt_ids, np.int32), key, future, holder, session))
        try:
            return await future
        except asyncio.CancelledError:
            self._inbox.put(("cancel", holder))
            raise

    def swap(self, load) -> float:
        """Run `load()` (the engine's load_policy) on the engine's thread between two steps and
        return when it is done; rows in flight run on under the new weights. Thread-safe; from
        any thread but the engine's own. Returns the seconds it waited for the step running.
        Where no worker thread runs (not started, stopped), `load()` runs here and now."""
        t0 = time.perf_counter()
        if not self.running:
            load()
            return 0.0
        done = {"event": threading.Event()}
        self._inbox.put(("load", load, done))
        while not done["event"].wait(self.idle_poll_s):
            if not self.running and not done["event"].is_set():   # stopped before taking it: nobody steps now
                load()
                return time.perf_counter() - t0
        if "error" in done:
            raise done["error"]
        return done["started"] - t0

    # --- the engine's thread -------------------------------------------------------------------
    def _deliver(self, future: asyncio.Future, value=None, error: BaseException | None = None) -> None:
        def settle():
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)
        self._loop.call_soon_threadsafe(settle)

    def _take_inbox(self, block: bool) -> None:
        s = self.settings
        while True:
            try:
                item = self._inbox.get(timeout=self.idle_poll_s) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if item[0] == "cancel":
                req = item[1].get("request")
                if req is not None:
                    self.engine.cancel(req)
                    self._futures.pop(req.rid, None)
                continue
            if item[0] == "load":
                _, load, done = item
                done["started"] = time.perf_counter()
                try:
                    load()
                except BaseException as err:  # noqa: BLE001 - raised in the caller's thread (swap)
                    done["error"] = err
                done["event"].set()
                continue
            _, prompt, key, future, holder, session = item
            try:
                req = self.engine.submit(prompt, n=s.n, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                         top_p=s.top_p, top_k=s.top_k, key=key, on_done=self._finished, session=session)
                holder["request"] = req
                self._futures[req.rid] = (future, req)
            except Exception as err:  # noqa: BLE001 - a bad state fails alone, with the reason
                self._deliver(future, error=SamplerError(f"{type(err).__name__}: {err}"))

    def _finished(self, request) -> None:
        entry = self._futures.pop(request.rid, None)
        if entry is None:    # withdrawn meanwhile
            return
        self.stats.states += 1
        generations = Versioned(request.generations)
        generations.version = request.oldest_version
        self._deliver(entry[0], generations)

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._take_inbox(block=not self.engine.busy)
            if not self.engine.busy:
                continue
            t0 = time.perf_counter()
            try:
                self.engine.step()
            except Exception as err:  # noqa: BLE001 - handed to every waiting state
                wrapped = err if isinstance(err, SamplerError) else SamplerError(f"{type(err).__name__}: {err}")
                self.engine.abort()
                for future, _ in self._futures.values():
                    self._deliver(future, error=wrapped)
                self._futures.clear()
            finally:
                self.stats.busy_s += time.perf_counter() - t0
            self.stats.calls += 1


__all__ = ["EngineSampling", "EngineWorker"]
