"""One MCP server connection through the official SDK: start (a sandboxed stdio command, a
sandboxed HTTP command on a free loopback port, or an existing streamable-HTTP URL), list its
tools, call them under a wall-clock limit, close. Every method runs on the pool's loop thread.

Faults raise `McpFault` with a short reason the episode records:
mcp_start_failed, mcp_timeout, mcp_connection_lost (the server died or closed its stream),
mcp_protocol_error (garbage, an oversized message, a reply that is not a tool result).
After a fault the connection is unusable; the pool replaces the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field
from typing import Any

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from actionopd_jax.envs.mcp.convert import ToolResult, tool_result, tool_schema
from actionopd_jax.envs.mcp.sandbox import Limits, Sandbox, SandboxedProcess
from actionopd_jax.envs.mcp.transport import TransportClosed, sandboxed_stdio
from actionopd_jax.types import ToolSchema


class McpFault(RuntimeError):
    """A server failure that ends the episode; `end_reason` is what the trajectory records."""

    def __init__(self, end_reason: str, detail: str):
        super().__init__(f"{end_reason}: {detail}")
        self.end_reason = end_reason
        self.detail = detail


@dataclass(frozen=True)
class ServerSpec:
    """How to reach one server. `command` alone: a stdio server. `command` with a "{port}"
    argument: an HTTP server started on a free 127.0.0.1 port, reached at `url` (default
    http://127.0.0.1:{port}/mcp). "{fd}" instead: the same, but we bind and listen on that
    port and hand the server the socket's file descriptor, so it keeps the private network
    namespace (it accepts our connections, it can open none of its own). `url` alone: an existing streamable-HTTP server (not
    sandboxed: we did not start it; every pool slot is one more MCP session on it, so unless
    the server keeps state per session, its episodes share state: use a pool of 1).
    "{workdir}" in `command` is the server's private dir."""

    command: tuple[str, ...] = ()
    url: str = ""
    call_timeout_s: float = 30.0
    start_timeout_s: float = 30.0
    limits: Limits = field(default_factory=Limits)
    env: tuple[tuple[str, str], ...] = ()  # extra (non-secret) environment for the server

    def __post_init__(self) -> None:
        if not self.command and not self.url:
            raise ValueError("an MCP server needs a command (stdio / HTTP) or a url")
        if self.call_timeout_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError("call_timeout_s and start_timeout_s must be > 0")

    @property
    def http_command(self) -> bool:
        return self.socket_command or any("{port}" in a for a in self.command)

    @property
    def socket_command(self) -> bool:
        return any("{fd}" in a for a in self.command)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


# How long a failed call waits for the server's exit before it names the failure: over HTTP the
# SDK sees the stream end ("SSE stream ended without a response") before we see the exit.
EXIT_GRACE_S = 1.0


def _exit_text(code: int) -> str:
    # the launcher exits 128 + N for a server killed by signal N; a negative code: the
    # launcher itself was killed (by us, at a close)
    if code > 128:
        return f"the server was killed by signal {code - 128}"
    if code < 0:
        return f"the server was killed by signal {-code}"
    return f"the server exited with code {code}"


def _fault_of(err: BaseException, proc: SandboxedProcess | None, during: str = "") -> McpFault:
    if isinstance(err, McpFault):
        return err
    tail = f" (its stderr ends: {proc.stderr_tail(300).strip()})" if proc is not None and proc.stderr_tail(1) else ""
    if isinstance(err, TransportClosed) or (proc is not None and proc.transport_error):
        return McpFault("mcp_protocol_error", f"{(proc.transport_error if proc else '') or err}{tail}")
    if proc is not None and not proc.alive():
        when = f" during {during}" if during else ""
        return McpFault("mcp_connection_lost", f"{_exit_text(proc.process.returncode)}{when}{tail}")
    text = f"{type(err).__name__}: {err}"
    if any(w in text.lower() for w in ("closed", "connection", "broken", "eof", "disconnect")):
        return McpFault("mcp_connection_lost", text + tail)
    return McpFault("mcp_protocol_error", text + tail)


class McpServer:
    """A live connection (and, for commands, the sandboxed process behind it)."""

    def __init__(self, spec: ServerSpec, sandbox: Sandbox | None = None):
        self.spec = spec
        self.sandbox = sandbox or Sandbox(spec.limits, extra_env=dict(spec.env))
        self.proc: SandboxedProcess | None = None
        self.workdir = None
        self.tools: list[ToolSchema] = []
        self.session: ClientSession | None = None
        self._stop = asyncio.Event()
        self._owner: asyncio.Task | None = None
        self._failed: McpFault | None = None
        self._lost: asyncio.Event = asyncio.Event()

    @property
    def usable(self) -> bool:
        return self.session is not None and self._failed is None and not self._lost.is_set() and \
            (self.proc is None or self.proc.alive())

    async def start(self) -> "McpServer":
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        try:
            url = self.spec.url
            if self.spec.command:
                self.workdir = self.sandbox.new_workdir()
                listener = _listener() if self.spec.socket_command else None
                port = listener.getsockname()[1] if listener else _free_port() if self.spec.http_command else None
                fd = listener.fileno() if listener else None
                argv = [a.format(port=port, workdir=self.workdir, fd=fd) for a in self.spec.command]
                try:
                    self.proc = await self.sandbox.spawn(argv, workdir=self.workdir, stdio=port is None,
                                                         network=port is not None and listener is None,
                                                         pass_fds=(fd,) if listener else ())
                finally:
                    if listener is not None:
                        listener.close()  # the server holds its own copy
                if port is not None:
                    url = (url or "http://127.0.0.1:{port}/mcp").format(port=port)
                    await self._wait_for_port(port)
            self._owner = asyncio.create_task(self._own(url, ready))
            await asyncio.wait_for(asyncio.shield(ready), self.spec.start_timeout_s)
        except BaseException as err:
            await self.close()
            if isinstance(err, asyncio.CancelledError):
                raise
            if isinstance(err, asyncio.TimeoutError):
                raise McpFault("mcp_start_failed", f"no tool list within {self.spec.start_timeout_s}s") from None
            raise McpFault("mcp_start_failed", str(_fault_of(err, self.proc))) from err
        return self

    async def _wait_for_port(self, port: int) -> None:
        deadline = asyncio.get_running_loop().time() + self.spec.start_timeout_s
        while True:
            if not self.proc.alive():
                raise McpFault("mcp_start_failed", f"HTTP server exited with {self.proc.process.returncode}: "
                                                   f"{self.proc.stderr_tail(300)}")
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                return
            if asyncio.get_running_loop().time() > deadline:
                raise McpFault("mcp_start_failed", f"nothing listens on port {port}")
            await asyncio.sleep(0.02)

    async def _own(self, url: str, ready: asyncio.Future) -> None:
        # The SDK's context managers must be entered and left by one task: this one holds
        # them for the connection's life; calls from other tasks go through `self.session`.
        try:
            async with contextlib.AsyncExitStack() as stack:
                if self.proc is not None and not url:
                    streams = await stack.enter_async_context(sandboxed_stdio(self.proc))
                else:
                    streams = await stack.enter_async_context(streamable_http_client(url, terminate_on_close=False))
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                tools, cursor = [], None
                while True:
                    listed = await session.list_tools(params={"cursor": cursor} if cursor else None)
                    tools.extend(listed.tools)
                    cursor = listed.next_cursor
                    if not cursor:
                        break
                self.tools = [tool_schema(t) for t in tools]
                if self.proc is not None:
                    self.proc.record_baseline()  # what it started itself, before any tool ran
                self.session = session
                ready.set_result(None)
                waiters = [asyncio.create_task(self._stop.wait())]
                if self.proc is not None:
                    waiters.append(asyncio.create_task(self.proc.process.wait()))
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
        except BaseException as err:  # noqa: BLE001 - recorded; the caller sees it as a fault
            if not ready.done():
                ready.set_exception(err if isinstance(err, Exception) else RuntimeError(repr(err)))
            if not isinstance(err, (asyncio.CancelledError, Exception)):
                raise
        finally:
            self._lost.set()

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        if not self.usable:
            raise self._failed or McpFault("mcp_connection_lost", "the server is gone")
        lost = asyncio.create_task(self._lost.wait())
        call = asyncio.create_task(self.session.call_tool(name, arguments))
        try:
            done, _ = await asyncio.wait({call, lost}, timeout=self.spec.call_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if call in done:
                try:
                    return tool_result(call.result())
                except Exception as err:  # noqa: BLE001
                    raise await self._fault(err, name) from err
            if lost in done:
                await asyncio.sleep(0)  # let the transport's own verdict (garbage vs EOF) land
                raise await self._fault(ConnectionError("connection closed"), name)
            raise McpFault("mcp_timeout", f"tools/call {name} exceeded {self.spec.call_timeout_s}s")
        except McpFault as fault:
            self._failed = fault
            raise
        finally:
            for t in (call, lost):
                t.cancel()
            await asyncio.gather(call, lost, return_exceptions=True)

    async def _fault(self, err: BaseException, name: str) -> McpFault:
        """The fault a failed call records. When our server process is ending, wait for its
        exit (briefly) so the fault says it exited, and with which code, rather than what the
        SDK saw first of it (an SSE stream that ended, a closed pipe)."""
        if self.proc is not None and not isinstance(err, McpFault) and not self.proc.transport_error:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.proc.process.wait()), EXIT_GRACE_S)
        return _fault_of(err, self.proc, during=f"tools/call {name}")

    async def end_strays(self) -> bool:
        """Before a reset: end every process its tools started (forked children, daemons);
        False when that failed and the server must be replaced. A url-only server is not ours."""
        if self.proc is None:
            return True
        return await asyncio.to_thread(self.proc.end_strays)

    async def close(self) -> None:
        self._stop.set()
        if self.proc is not None:
            self.proc.kill()  # first, so a stuck transport shutdown has nothing to wait for
        if self._owner is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._owner), 5.0)
            except BaseException:  # noqa: BLE001
                self._owner.cancel()
        if self.proc is not None:
            await self.proc.close()
        self.session = None
