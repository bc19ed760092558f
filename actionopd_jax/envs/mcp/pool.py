"""A bounded pool of MCP servers serving many concurrent episodes, reusing each server across
episodes with a reset between them.

At most `size` servers exist; `acquire` hands out an idle, reset server, starts a new one while
under the bound, or waits. `release(server, ok=True)` resets it in the background and returns
it to the idle set; a faulted server (ok=False), or one whose reset fails, is closed and its
slot freed. A reset first kills every process the episode's tools left in the server's pid
namespace (forked children, daemons; envs/mcp/strays.py). Reset modes (`reset`):
  "fresh"            a new server per episode (the old one is closed);
  "tool:NAME"        call the server's tool NAME;
  "command:ARGV..."  run a short command (shell-split) in the server's private directory,
                     contained like the server (e.g. restore a database file).
Everything runs on one `LoopThread`; episodes on other loops call through `LoopThread.run`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import shlex
import shutil
import time
import weakref
from dataclasses import dataclass, field

from actionopd_jax.envs.mcp.client import McpFault, McpServer, ServerSpec
from actionopd_jax.envs.mcp.convert import tool_evidence
from actionopd_jax.envs.mcp.loop import LoopThread


def parse_reset(reset: str) -> tuple[str, str | list[str]]:
    if reset == "fresh":
        return "fresh", ""
    kind, _, arg = reset.partition(":")
    if kind == "tool" and arg.strip():
        return "tool", arg.strip()
    if kind == "command" and arg.strip():
        return "command", shlex.split(arg)
    raise ValueError(f"env.mcp_reset must be 'fresh', 'tool:NAME' or 'command:ARGV', got {reset!r}")


@dataclass
class PoolStats:
    starts: int = 0
    start_s: list[float] = field(default_factory=list)
    resets: int = 0
    reset_s: list[float] = field(default_factory=list)
    discarded: int = 0


class McpPool:
    def __init__(self, spec: ServerSpec, *, size: int, reset: str = "fresh", reset_timeout_s: float = 30.0,
                 loop: LoopThread | None = None):
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        self.spec, self.size = spec, size
        self.reset_kind, self.reset_arg = parse_reset(reset)
        if spec.url and not spec.command and self.reset_kind != "tool":
            raise ValueError("a url-only MCP server can only be reset through a tool (env.mcp_reset: tool:NAME)")
        self.reset_timeout_s = reset_timeout_s
        self.loop = loop or LoopThread("mcp-pool")
        self._own_loop = loop is None
        self.stats = PoolStats()
        self._idle: list[McpServer] = []
        self._live: set[McpServer] = set()
        self._cond: asyncio.Condition | None = None  # created on the pool loop
        self._closed = False
        self._pending: set = set()  # releases from synchronous code still running
        self._finalizer = weakref.finalize(self, _kill_all, self._live)
        atexit.register(self._finalizer)

    # --- called from any loop --------------------------------------------------------------

    async def acquire(self) -> McpServer:
        return await self.loop.run(self._acquire())

    async def release(self, server: McpServer, *, ok: bool) -> None:
        await self.loop.run(self._release(server, ok))

    def release_soon(self, server: McpServer, *, ok: bool) -> None:
        """Release from synchronous code (Environment.score/end): runs on the pool loop."""
        if not self.loop.closed:
            future = self.loop.submit(self._release(server, ok))
            self._pending.add(future)
            future.add_done_callback(self._pending.discard)

    def warm(self, count: int | None = None, timeout_s: float = 600.0) -> None:
        """Start up to `count` servers (default: the pool's size) now, so that no episode, and
        no device step behind it, waits for a cold start."""
        self.loop.run_sync(self._warm(min(count or self.size, self.size)), timeout=timeout_s)

    def evidence(self, sources: dict[str, str] | None = None) -> dict[str, str]:
        """Tool name -> matcher evidence (description + input schema, + `sources[name]`, the
        implementation, when the environment ships it), read from one server's tool list."""
        async def read() -> dict[str, str]:
            server = await self._acquire()
            try:
                return {t["function"]["name"]: tool_evidence(t, (sources or {}).get(t["function"]["name"]))
                        for t in server.tools}
            finally:
                await self._release(server, True)

        return self.loop.run_sync(read(), timeout=120)

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

    def __enter__(self) -> "McpPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- on the pool loop -------------------------------------------------------------------

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _acquire(self) -> McpServer:
        cond = self._condition()
        async with cond:
            while True:
                if self._closed:
                    raise McpFault("mcp_pool_closed", "the server pool is closed")
                while self._idle:
                    server = self._idle.pop()
                    if server.usable:
                        return server
                    await self._discard(server)
                if len(self._live) < self.size:
                    placeholder = McpServer(self.spec)
                    self._live.add(placeholder)  # hold the slot while it starts
                    break
                await cond.wait()
        t0 = time.perf_counter()
        try:
            await placeholder.start()
        except BaseException:
            async with cond:
                self._live.discard(placeholder)
                cond.notify()
            raise
        self.stats.starts += 1
        self.stats.start_s.append(time.perf_counter() - t0)
        return placeholder

    async def _warm(self, count: int) -> None:
        servers = await asyncio.gather(*(self._acquire() for _ in range(count - len(self._live))))
        cond = self._condition()
        async with cond:
            self._idle.extend(servers)  # fresh servers need no reset
            cond.notify_all()

    async def _release(self, server: McpServer, ok: bool) -> None:
        cond = self._condition()
        if ok and server.usable and not self._closed and self.reset_kind != "fresh":
            t0 = time.perf_counter()
            ok = await self._reset(server)
            if ok:
                self.stats.resets += 1
                self.stats.reset_s.append(time.perf_counter() - t0)
        else:
            ok = False
        async with cond:
            if ok:
                self._idle.append(server)
            else:
                self._live.discard(server)  # the slot frees now; the close need not hold the lock
                self.stats.discarded += 1
            cond.notify()
        if not ok:
            await server.close()

    async def _reset(self, server: McpServer) -> bool:
        try:
            if not await server.end_strays():  # a tool's leftover processes end with its episode
                return False
            if self.reset_kind == "tool":
                result = await asyncio.wait_for(server.call(self.reset_arg, {}), self.reset_timeout_s)
                return not result.is_error
            code, _ = await server.sandbox.run(list(self.reset_arg), workdir=server.workdir,
                                               timeout_s=self.reset_timeout_s)
            return code == 0
        except (McpFault, asyncio.TimeoutError, OSError):
            return False

    async def _discard(self, server: McpServer) -> None:
        self._live.discard(server)
        self.stats.discarded += 1
        await server.close()

    async def _close_all(self) -> None:
        pending = [asyncio.wrap_future(f) for f in list(self._pending)]
        if pending:
            await asyncio.wait(pending, timeout=10)
        cond = self._condition()
        async with cond:
            servers = list(self._live)
            self._idle.clear()
            cond.notify_all()
        await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)
        self._live.difference_update(servers)


def _kill_all(live: set) -> None:
    # last resort at interpreter exit or garbage collection: SIGKILL every group and remove
    # the private directories, synchronously (the pool's loop may be gone)
    for server in list(live):
        if server.proc is not None:
            server.proc.kill()
            shutil.rmtree(server.proc.workdir, ignore_errors=True)
            with contextlib.suppress(OSError):
                server.proc.stderr_path.unlink()
