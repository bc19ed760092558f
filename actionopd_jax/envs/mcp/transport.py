"""An MCP stdio transport over a sandboxed process's pipes, with a bound on message size.

The SDK's own stdio client spawns the process itself (outside our sandbox) and buffers a line
of any length; this one reads lines of at most `max_line_bytes` (asyncio's stream limit), so a
server that prints 100 MB without a newline costs the trainer a bounded buffer and ends the
connection instead. An unparsable line is handed to the session as an exception (the SDK's
convention), which fails the requests waiting on it.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

import anyio
import mcp_types
from mcp.shared.message import SessionMessage

from actionopd_jax.envs.mcp.sandbox import SandboxedProcess


class TransportClosed(ConnectionError):
    """The server's stdout ended, overflowed or stopped being MCP."""


@asynccontextmanager
async def sandboxed_stdio(proc: SandboxedProcess) -> AsyncIterator[tuple]:
    """(read_stream, write_stream) for `mcp.ClientSession` over `proc`'s stdin/stdout."""
    reader, writer = proc.process.stdout, proc.process.stdin
    read_send, read_recv = anyio.create_memory_object_stream[SessionMessage | Exception](16)
    write_send, write_recv = anyio.create_memory_object_stream[SessionMessage](16)

    async def fail(text: str) -> None:
        proc.transport_error = text
        await read_send.send(TransportClosed(text))

    async def pump_out() -> None:
        async with read_send:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    await fail("server sent a line over the message size limit")
                    return
                except (ConnectionError, OSError) as err:
                    await fail(f"server stdout failed: {err}")
                    return
                if not line:
                    return  # EOF: the session sees the stream close (connection lost)
                if not line.strip():
                    continue
                try:
                    message = mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except ValueError as err:
                    await fail(f"server sent a non-MCP line: {str(err)[:200]}")
                    return
                await read_send.send(SessionMessage(message))

    async def pump_in() -> None:
        async with write_recv:
            async for item in write_recv:
                data = item.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                try:
                    writer.write(data.encode())
                    await writer.drain()
                except (ConnectionError, OSError):
                    return

    async with anyio.create_task_group() as tg:
        tg.start_soon(pump_out)
        tg.start_soon(pump_in)
        try:
            yield read_recv, write_send
        finally:
            tg.cancel_scope.cancel()
            await write_send.aclose()
            await read_recv.aclose()
