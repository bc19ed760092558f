"""`stream: true` for chat completions: the finished choices as OpenAI server-sent events.

The events are those of the OpenAI chat-completions stream: `chat.completion.chunk` objects
whose `delta` carries the role, then content (and vLLM-style `reasoning_content`) in pieces,
then each tool call (index, id, type and name first, its arguments in pieces), then a chunk
with the finish reason; a usage-only chunk when `stream_options.include_usage`; then
`data: [DONE]`. Joining the deltas gives the non-streamed message.

The events are sent once generation has finished: the batched sampler returns whole
sequences (the decode loop runs on device), so there is no token-by-token stream to relay.
A client still gets a well-formed stream; only the time to the first chunk is not shortened.
Token logprobs ride on each choice's finish chunk.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from aiohttp import web

PIECE_CHARS = 24  # characters of content / arguments per chunk


def _pieces(text: str) -> Iterator[str]:
    for i in range(0, len(text), PIECE_CHARS):
        yield text[i:i + PIECE_CHARS]


def chunk_events(body: dict[str, Any], *, include_usage: bool) -> Iterator[dict[str, Any]]:
    """The stream's chunks for a finished non-streamed completion `body` (openai_http.completion_body)."""
    head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"],
            "system_fingerprint": None}

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs=None) -> dict[str, Any]:
        out = {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    for choice in body["choices"]:
        i, message = choice["index"], choice["message"]
        yield chunk(i, {"role": "assistant", "content": ""})
        for piece in _pieces(message.get("reasoning_content") or ""):
            yield chunk(i, {"reasoning_content": piece})
        for piece in _pieces(message.get("content") or ""):
            yield chunk(i, {"content": piece})
        for k, call in enumerate(message.get("tool_calls") or []):
            fn = call["function"]
            yield chunk(i, {"tool_calls": [{"index": k, "id": call["id"], "type": call["type"],
                                            "function": {"name": fn["name"], "arguments": ""}}]})
            for piece in _pieces(fn["arguments"]):
                yield chunk(i, {"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
        yield chunk(i, {}, choice["finish_reason"], choice.get("logprobs"))
    if include_usage:
        yield {**head, "choices": [], "usage": body["usage"]}


async def send_stream(request: web.Request, body: dict[str, Any], *, include_usage: bool) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        for event in chunk_events(body, include_usage=include_usage):
            await resp.write(f"data: {json.dumps(event, ensure_ascii=False, allow_nan=False)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass  # the client left mid-stream; nothing to tell it
    return resp
