"""A bounded pool of MCP servers of many kinds (one kind per key: an AWM scenario, an EnvScaler
environment), each reused across episodes of its key with a reset in between.

At most `size` servers live at once, whatever their keys. `acquire(key)` hands out an idle,
reset server of that key; else starts one while under the bound; else closes the idle server
used least recently (of another key) and starts one in its slot; else waits for a release.
`release(server, ok=True)` kills the processes the episode's tools left (envs/mcp/strays.py), runs
`reset(key, server)` and returns the server to the idle set; a
faulted server (ok=False), or one whose reset fails or times out, is closed and its slot freed.
`make_server(key)` builds the (unstarted) `McpServer` of a key, e.g. with a sandbox whose
private directory already holds the episode's database.

`prefetch(keys)` starts, in the background, servers for episodes about to begin (a training
step's drawn task starts, known before the step): an episode whose key has a prefetched server
still starting waits for that one instead of starting its own, and a prefetch never evicts an
idle server of a key it wants, nor holds a slot while it waits for one (episodes always can
make progress). A newer prefetch supersedes the pending requests of an older one.

Everything runs on one `LoopThread` (loop.py), as `McpPool`; `view(key)` is the per-key face
`McpEnv` drives (acquire / release_soon / loop).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Hashable

from actionopd_jax.envs.mcp.client import McpFault, McpServer
from actionopd_jax.envs.mcp.loop import LoopThread
from actionopd_jax.envs.mcp.pool import PoolStats, _kill_all

ResetFn = Callable[[Hashable, McpServer], Awaitable[bool]]


@dataclass
class KeyedStats(PoolStats):
    evicted: int = 0  # idle servers closed to make room for another key
    reset_failures: int = 0
    keys_started: dict = field(default_factory=dict)  # key -> servers started for it
    prefetched: int = 0  # servers started by `prefetch`
    acquire_s: list[float] = field(default_factory=list)  # what each episode's lease took (waits included)


class KeyedPool:
    def __init__(self, make_server: Callable[[Hashable], McpServer], *, size: int, reset: ResetFn,
                 reset_timeout_s: float = 30.0, loop: LoopThread | None = None):
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        self.size = size
        self._make, self._reset_fn, self.reset_timeout_s = make_server, reset, reset_timeout_s
        self.loop = loop or LoopThread("mcp-keyed-pool")
        self._own_loop = loop is None
        self.stats = KeyedStats()
        self._idle: list[McpServer] = []  # oldest release first (eviction order)
        self._live: set[McpServer] = set()
        self._key: dict[int, Hashable] = {}  # id(server) -> its key
        self._cond: asyncio.Condition | None = None
        self._closed = False
        self._pending: set = set()
        self._closing: set[asyncio.Task] = set()
        # prefetch bookkeeping (pool loop only): the latest prefetch call, its keys (protected
        # from a prefetch's eviction), its starts not yet holding a slot, and starts under way
        self._gen = 0
        self._protect: frozenset = frozenset()
        self._wanted: Counter = Counter()
        self._starting: Counter = Counter()
        self._prefetch_tasks: set[asyncio.Task] = set()
        self._finalizer = weakref.finalize(self, _kill_all, self._live)
        atexit.register(self._finalizer)

    def key_of(self, server: McpServer) -> Hashable:
        return self._key[id(server)]

    def view(self, key: Hashable) -> "PoolView":
        return PoolView(self, key)

    # --- called from any loop / thread ----------------------------------------------------

    async def acquire(self, key: Hashable) -> McpServer:
        return await self.loop.run(self._acquire(key))

    async def release(self, server: McpServer, *, ok: bool) -> None:
        await self.loop.run(self._release(server, ok))

    def release_soon(self, server: McpServer, *, ok: bool) -> None:
        if not self.loop.closed:
            future = self.loop.submit(self._release(server, ok))
            self._pending.add(future)
            future.add_done_callback(self._pending.discard)

    def prefetch(self, keys: list[Hashable]) -> concurrent.futures.Future:
        """Start servers for upcoming episodes of `keys` (a key once per episode) in the
        background, as many as are not idle or starting already and as the pool's bound allows;
        returns at once (the future gives the number started). Superseded by the next call."""
        return self.loop.submit(self._prefetch(list(keys)))

    def warm(self, keys: list[Hashable], timeout_s: float = 600.0) -> dict[Hashable, list]:
        """Start one server per key (at most `size` at a time; the last `size` stay idle for
        the first episodes) and return each key's tool list, so that no episode, and no device
        step behind it, waits for a cold start of these keys. A key whose server fails to start
        maps to its `McpFault`."""
        return self.loop.run_sync(self._warm(list(keys)), timeout=timeout_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.loop.closed:
            try:
                self.loop.run_sync(self._close_all(), timeout=30)
            except Exception:  # noqa: BLE001 - whatever is left is killed below
                pass
        _kill_all(self._live)
        if self._own_loop:
            self.loop.close()

    def __enter__(self) -> "KeyedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- on the pool loop -------------------------------------------------------------------

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _close_later(self, server: McpServer) -> None:
        task = asyncio.get_running_loop().create_task(server.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _forget(self, server: McpServer) -> None:
        self._live.discard(server)
        self._key.pop(id(server), None)

    def _take_idle(self, key: Hashable) -> McpServer | None:
        for i in range(len(self._idle) - 1, -1, -1):  # the most recently reset first
            server = self._idle[i]
            if self._key.get(id(server)) != key:
                continue
            del self._idle[i]
            if server.usable:
                return server
            self._forget(server)
            self.stats.discarded += 1
            self._close_later(server)
        return None

    def _evict_one(self, *, for_prefetch: bool) -> None:
        """Close the idle server released longest ago, preferring keys no prefetch wants; a
        prefetch evicts only those."""
        victim = next((s for s in self._idle if self._key.get(id(s)) not in self._protect), None)
        if victim is None and not for_prefetch and self._idle:
            victim = self._idle[0]
        if victim is not None:
            self._idle.remove(victim)
            self._forget(victim)
            self.stats.evicted += 1
            self._close_later(victim)

    def _hold_slot(self, key: Hashable) -> McpServer:
        server = self._make(key)
        self._live.add(server)  # hold the slot while it starts
        self._key[id(server)] = key
        return server

    async def _acquire(self, key: Hashable) -> McpServer:
        t0 = time.perf_counter()
        try:
            return await self._lease(key)
        finally:
            self.stats.acquire_s.append(time.perf_counter() - t0)

    async def _lease(self, key: Hashable) -> McpServer:
        cond = self._condition()
        async with cond:
            while True:
                if self._closed:
                    raise McpFault("mcp_pool_closed", "the server pool is closed")
                server = self._take_idle(key)
                if server is not None:
                    return server
                if self._starting[key] > 0:  # a prefetched server of this key is starting: take that one
                    await cond.wait()
                    continue
                if len(self._live) >= self.size:
                    self._evict_one(for_prefetch=False)
                if len(self._live) < self.size:
                    server = self._hold_slot(key)
                    if self._wanted[key] > 0:
                        self._wanted[key] -= 1  # this start serves a pending prefetch request
                    break
                await cond.wait()
        t0 = time.perf_counter()
        try:
            await server.start()
        except BaseException:
            async with cond:
                self._forget(server)
                cond.notify()
            raise
        self.stats.starts += 1
        self.stats.start_s.append(time.perf_counter() - t0)
        self.stats.keys_started[key] = self.stats.keys_started.get(key, 0) + 1
        return server

    async def _prefetch(self, keys: list[Hashable]) -> int:
        cond = self._condition()
        async with cond:
            self._gen += 1
            gen, want = self._gen, Counter(keys)
            self._protect = frozenset(want)
            idle = Counter(self._key.get(id(s)) for s in self._idle)
            # never more than the pool holds: servers already idle or starting for these keys count
            room = self.size - sum(min(n, idle[k]) for k, n in want.items()) - sum(self._starting.values())
            plan: list[Hashable] = []
            for k, n in want.items():  # first-drawn keys first
                plan += [k] * max(0, n - idle[k] - self._starting[k])
            plan = plan[:max(0, room)]
            self._wanted = Counter()
            held: list[tuple[Hashable, McpServer | None]] = []
            for k in plan:  # slots free now are taken now, so an episode arriving next waits for these
                if len(self._live) >= self.size:
                    self._evict_one(for_prefetch=True)
                if len(self._live) < self.size:
                    self._starting[k] += 1
                    held.append((k, self._hold_slot(k)))
                else:
                    self._wanted[k] += 1
                    held.append((k, None))
            cond.notify_all()  # requests of an older prefetch give up
        tasks = [asyncio.get_running_loop().create_task(self._prefetch_one(k, gen, server)) for k, server in held]
        self._prefetch_tasks.update(tasks)
        for t in tasks:
            t.add_done_callback(self._prefetch_tasks.discard)
        done = await asyncio.gather(*tasks, return_exceptions=True)
        return sum(d is True for d in done)

    async def _prefetch_one(self, key: Hashable, gen: int, server: McpServer | None) -> bool:
        cond = self._condition()
        async with cond:
            while server is None:
                if self._closed or gen != self._gen or self._wanted[key] <= 0:
                    return False  # superseded, or an episode's own start served it
                if len(self._live) >= self.size:
                    self._evict_one(for_prefetch=True)
                if len(self._live) < self.size:
                    self._wanted[key] -= 1
                    self._starting[key] += 1
                    server = self._hold_slot(key)
                else:
                    await cond.wait()
        t0 = time.perf_counter()
        try:
            await server.start()
            ok = not self._closed
        except (McpFault, OSError, asyncio.TimeoutError):
            ok = False
        except asyncio.CancelledError:
            ok = False  # the pool is closing
        async with cond:
            self._starting[key] -= 1
            if ok:
                self._idle.append(server)  # fresh: no reset needed
                self.stats.starts += 1
                self.stats.prefetched += 1
                self.stats.start_s.append(time.perf_counter() - t0)
                self.stats.keys_started[key] = self.stats.keys_started.get(key, 0) + 1
            else:
                self._forget(server)
                self._close_later(server)
            cond.notify_all()
        return ok

    async def _warm(self, keys: list[Hashable]) -> dict[Hashable, Any]:
        out: dict[Hashable, Any] = {}
        gate = asyncio.Semaphore(self.size)

        async def one(key: Hashable) -> None:
            async with gate:
                try:
                    server = await self._lease(key)
                except McpFault as fault:
                    out[key] = fault
                    return
                out[key] = list(server.tools)
                cond = self._condition()
                async with cond:
                    self._idle.append(server)  # fresh: no reset needed
                    cond.notify_all()

        await asyncio.gather(*(one(k) for k in keys))
        return out

    async def _release(self, server: McpServer, ok: bool) -> None:
        cond = self._condition()
        key = self._key.get(id(server))
        if ok and key is not None and server.usable and not self._closed:
            t0 = time.perf_counter()
            try:
                # a tool's leftover processes end with its episode, then the state is reset
                ok = await server.end_strays() and \
                    bool(await asyncio.wait_for(self._reset_fn(key, server), self.reset_timeout_s))
            except (McpFault, asyncio.TimeoutError, OSError, RuntimeError, ValueError):
                ok = False
            if ok:
                self.stats.resets += 1
                self.stats.reset_s.append(time.perf_counter() - t0)
            else:
                self.stats.reset_failures += 1
        else:
            ok = False
        async with cond:
            if ok:
                self._idle.append(server)
            else:
                self._forget(server)
                self.stats.discarded += 1
            cond.notify()
        if not ok:
            await server.close()

    async def _close_all(self) -> None:
        pending = [asyncio.wrap_future(f) for f in list(self._pending)]
        if pending:
            await asyncio.wait(pending, timeout=10)
        for task in list(self._prefetch_tasks):
            task.cancel()
        await asyncio.gather(*list(self._prefetch_tasks), return_exceptions=True)
        cond = self._condition()
        async with cond:
            servers = list(self._live)
            self._idle.clear()
            cond.notify_all()
        await asyncio.gather(*(s.close() for s in servers), *list(self._closing), return_exceptions=True)
        for s in servers:
            self._forget(s)


class PoolView:
    """One key's face of a `KeyedPool`, with the calls `McpEnv` makes of a pool."""

    reset_kind = "keyed"  # never "tool": no listed tool is hidden from the agent
    reset_arg = ""

    def __init__(self, pool: KeyedPool, key: Hashable):
        self.pool, self.key = pool, key
        self.loop = pool.loop

    async def acquire(self) -> McpServer:
        return await self.pool.acquire(self.key)

    def release_soon(self, server: McpServer, *, ok: bool) -> None:
        self.pool.release_soon(server, ok=ok)
