"""`stream: true` for chat completions: the finished choices as OpenAI server-sent events.

The events are those of the OpenAI chat-completions stream: `chat.completion.chunk` objects
whose `delta` carries the role, then content (and vLLM-style `reasoning_content`) in pieces,
then each tool call (index, id, type and name first, its arguments in pieces), then a chunk
with the finish reason; a usage-only chunk when `stream_options.include_usage`; then
`data: [DONE]`. Joining the deltas gives the non-streamed message.

A backend that `streams_live` (a model served through the continuous-batching engine) sends
reasoning and content as its segments generate them (`send_live_stream`; what is sent when:
serve/stream_text.py), then each choice's rest, tool calls and finish chunk once all its
samples are done. Other backends (the static sampler returns whole sequences) send the events
once generation has finished (`send_stream`): a well-formed stream, without the shorter time to
the first chunk. Token logprobs ride on each choice's finish chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, Iterator

from aiohttp import web

from actionopd_jax.serve.requests import ChatRequest, RequestError, completion_body
from actionopd_jax.serve.stream_text import remainder

PIECE_CHARS = 24  # characters of content / arguments per chunk


def _pieces(text: str) -> Iterator[str]:
    for i in range(0, len(text), PIECE_CHARS):
        yield text[i:i + PIECE_CHARS]


def _head(body: dict[str, Any]) -> dict[str, Any]:
    return {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"],
            "system_fingerprint": None}


def _chunk(head: dict, include_usage: bool, index: int, delta: dict, finish: str | None = None,
           logprobs=None) -> dict[str, Any]:
    out = {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    if include_usage:
        out["usage"] = None
    return out


def _choice_end(head: dict, include_usage: bool, choice: dict, sent: dict[str, str]) -> Iterator[dict[str, Any]]:
    """A finished choice's chunks after what `sent` already streamed of its reasoning and content:
    their rest, each tool call (id, type and name first, its arguments in pieces), the finish."""
    i, message = choice["index"], choice["message"]
    for field in ("reasoning_content", "content"):
        for piece in _pieces(remainder(sent.get(field, ""), message.get(field))):
            yield _chunk(head, include_usage, i, {field: piece})
    for k, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        yield _chunk(head, include_usage, i, {"tool_calls": [{"index": k, "id": call["id"], "type": call["type"],
                                                              "function": {"name": fn["name"], "arguments": ""}}]})
        for piece in _pieces(fn["arguments"]):
            yield _chunk(head, include_usage, i, {"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
    yield _chunk(head, include_usage, i, {}, choice["finish_reason"], choice.get("logprobs"))


def chunk_events(body: dict[str, Any], *, include_usage: bool) -> Iterator[dict[str, Any]]:
    """The stream's chunks for a finished non-streamed completion `body` (openai_http.completion_body)."""
    head = _head(body)
    for choice in body["choices"]:
        yield _chunk(head, include_usage, choice["index"], {"role": "assistant", "content": ""})
        yield from _choice_end(head, include_usage, choice, {})
    if include_usage:
        yield {**head, "choices": [], "usage": body["usage"]}


def _data(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, ensure_ascii=False, allow_nan=False)}\n\n".encode()


async def send_live_stream(request: web.Request, req: ChatRequest, prompt_tokens: int,
                           events: AsyncIterator[tuple], stop: asyncio.Event | None = None) -> web.StreamResponse:
    """Stream a live backend's events (ModelBackend.stream) as they come. A failure after the
    stream has started is sent as an `error` event (the OpenAI SDK raises it as an APIError).
    `stop` set (the server's shutdown grace ran out) ends the stream with an error event
    saying so: the client sees the end of its stream, not a dropped connection."""
    body = completion_body(req, [], prompt_tokens)  # the id, created and model of every chunk
    head, usage = _head(body), req.include_usage
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    sent = [{"reasoning_content": "", "content": ""} for _ in range(req.n)]
    try:
        # `until` is closed before `events` is: a generator still inside its step cannot be closed
        async with contextlib.aclosing(events), contextlib.aclosing(_until(events, stop)) as until:
            for i in range(req.n):   # leaving early (the client went) withdraws the request (aclosing)
                await resp.write(_data(_chunk(head, usage, i, {"role": "assistant", "content": ""})))
            try:
                async for event in until:
                    if event is _STOPPED:   # the shutdown's grace ran out: the client is told so
                        await _end_cancelled(resp)
                        return resp
                    if event[0] == "delta":
                        _, i, field, piece = event
                        sent[i][field] += piece
                        await resp.write(_data(_chunk(head, usage, i, {field: piece})))
                        continue
                    final = completion_body(req, event[1], prompt_tokens)
                    for choice in final["choices"]:
                        for chunk in _choice_end(head, usage, choice, sent[choice["index"]]):
                            await resp.write(_data(chunk))
                    if usage:
                        await resp.write(_data({**head, "choices": [], "usage": final["usage"]}))
            except (ConnectionResetError, ConnectionError):
                raise
            except Exception as e:  # noqa: BLE001 - the client is told, the stream ends cleanly
                err = e if isinstance(e, RequestError) else RequestError(
                    500, f"backend error: {type(e).__name__}: {e}", "server_error")
                await resp.write(_data(err.body()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass  # the client left mid-stream: its request is withdrawn (aclosing above)
    except asyncio.CancelledError:
        # cancelled outright (the shutdown's last resort): a terminal event if the connection
        # still takes one, then the cancellation goes on
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_end_cancelled(resp), 1.0)
        raise
    return resp


_STOPPED = object()


async def _until(events: AsyncIterator[tuple], stop: asyncio.Event | None) -> AsyncIterator[Any]:
    """`events` as they come, then `_STOPPED` once `stop` is set (if it is before they end)."""
    if stop is None:
        async for event in events:
            yield event
        return
    it = events.__aiter__()
    waiting = asyncio.ensure_future(stop.wait())
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            await asyncio.wait({nxt, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                yield _STOPPED
                return
            try:
                event = nxt.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        waiting.cancel()
        # the generator's step must have ended before the caller closes `events` (aclosing):
        # closing a generator that is still running raises
        if nxt is not None and not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)


async def _end_cancelled(resp: web.StreamResponse) -> None:
    err = RequestError(503, "the server is shutting down: this request was cancelled after its grace period; "
                            "send it again to a running server", "server_error", "server_shutdown")
    await resp.write(_data(err.body()))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


async def send_stream(request: web.Request, body: dict[str, Any], *, include_usage: bool) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        for event in chunk_events(body, include_usage=include_usage):
            await resp.write(_data(event))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass  # the client left mid-stream; nothing to tell it
    return resp
