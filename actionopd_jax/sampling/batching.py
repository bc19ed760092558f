"""Micro-batching: requests that arrive together share one device call.

The first request opens a short collection window; everything submitted before it closes
(up to `max_items`) goes to `run_batch` in one worker thread call, so the event loop keeps
accepting requests while the device works (those then form the next batch). One worker
thread for all batches: device calls never overlap.

A result may be `Continue(item)`: the work is not finished (a long generation runs as
several device calls). The item is queued again ahead of new requests, and new requests join
its next call. An item whose request was abandoned (the client disconnected: the server
cancels its handler, which cancels the waiting future) is dropped before its next call, so a
gone client holds the device for at most one call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any, Callable, Sequence


@dataclasses.dataclass
class Continue:
    """A `run_batch` result meaning "not done: run `item` in a later call"."""

    item: Any


class MicroBatcher:
    def __init__(self, run_batch: Callable[[Sequence[Any]], Sequence[Any]], *, window_s: float = 0.005,
                 max_items: int = 64):
        if window_s < 0 or max_items < 1:
            raise ValueError("window_s must be >= 0 and max_items >= 1")
        self._run_batch = run_batch
        self.window_s = window_s
        self.max_items = max_items
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="device")
        self._queues: dict[asyncio.AbstractEventLoop, asyncio.Queue] = {}
        self._resumed: dict[asyncio.AbstractEventLoop, list] = {}  # Continue items, served first
        self._collecting: set[asyncio.AbstractEventLoop] = set()
        self.batch_sizes: list[int] = []  # one entry per device call (tests and metrics read it)
        self.abandoned = 0  # items dropped because their request was cancelled (client gone)

    async def submit(self, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        queue = self._queues.get(loop)
        if queue is None:
            queue = self._queues[loop] = asyncio.Queue()
            self._resumed[loop] = []
        future = loop.create_future()
        queue.put_nowait((item, future))
        # A collector runs only while work is queued, so no task is left pending when the
        # server's loop shuts down.
        if loop not in self._collecting:
            self._collecting.add(loop)
            loop.create_task(self._collect(queue, self._resumed[loop]))
        return await future

    async def _collect(self, queue: asyncio.Queue, resumed: list) -> None:
        loop = asyncio.get_running_loop()
        try:
            while resumed or not queue.empty():
                await self._one_batch(loop, queue, resumed)
        finally:
            self._collecting.discard(loop)

    def _live(self, batch: list) -> list:
        live = [(item, fut) for item, fut in batch if not fut.cancelled()]
        self.abandoned += len(batch) - len(live)
        return live

    async def _one_batch(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, resumed: list) -> None:
        batch = self._live(resumed[:self.max_items])
        del resumed[:self.max_items]
        if batch:
            # continuing work does not wait: it takes whatever arrived during the last call
            while len(batch) < self.max_items and not queue.empty():
                batch.append(queue.get_nowait())
        elif not queue.empty():
            batch.append(queue.get_nowait())
            deadline = loop.time() + self.window_s
            while len(batch) < self.max_items:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    # still take whatever is already waiting, without waiting longer
                    while len(batch) < self.max_items and not queue.empty():
                        batch.append(queue.get_nowait())
                    break
                try:
                    batch.append(await asyncio.wait_for(queue.get(), remaining))
                except asyncio.TimeoutError:
                    continue
        batch = self._live(batch)
        if not batch:
            return
        self.batch_sizes.append(len(batch))
        try:
            results = await loop.run_in_executor(self._executor, self._run_batch, [item for item, _ in batch])
        except Exception as e:  # noqa: BLE001 - delivered to every waiting request
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (_, fut), result in zip(batch, results):
            if isinstance(result, Continue):
                resumed.append((result.item, fut))
            elif not fut.done():
                fut.set_result(result)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
