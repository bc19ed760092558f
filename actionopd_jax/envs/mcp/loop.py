"""A dedicated event-loop thread that owns MCP connections and server processes.

The MCP SDK binds its streams and task groups to the loop that opened them, and a server's
death signal is tied to the thread that spawned it; the collector's loop, eval's and a test's
`asyncio.run` come and go. So every connection lives on this one long-lived loop, and other
loops await its work through `run` without blocking themselves (a cancelled caller cancels the
work here too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Coroutine, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "mcp-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def closed(self) -> bool:
        return self.loop.is_closed() or not self._thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on this thread's loop from any running loop."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def run_sync(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Block the calling (non-loop) thread until `coro` finishes here."""
        return self.submit(coro).result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


async def gather_quietly(*aws: Awaitable[Any]) -> None:
    await asyncio.gather(*aws, return_exceptions=True)
