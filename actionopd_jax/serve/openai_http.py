"""The OpenAI-compatible HTTP layer: request validation, response shape, errors, auth.

`stream: true` chat requests are answered as server-sent events (serve/streaming.py).
`POST /v1/completions` serves one thing only: vLLM-style scoring of given token ids (echo,
max_tokens 0) by a backend with `score_tokens` (serve/scoring.py).

What answers a request is a `Backend` (a model on device, a scripted policy, a fault
injector); this module only speaks the protocol. The server runs an aiohttp app on its own
event loop in a background thread, so tests and the main job can start it next to their own
asyncio code and talk to it with the real `openai` client.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web

# the protocol's types live in requests.py; they stay importable from here
from actionopd_jax.serve.http_errors import error_response as _error_response
from actionopd_jax.serve.http_errors import json_http_errors as _json_http_errors
from actionopd_jax.serve.requests import (Backend, ChatChoice, ChatRequest, RequestError,  # noqa: F401
                                          completion_body, hold_body_slot, requested_model)

# A body past this is refused (a JSON 413) before it is read: far above what any context the
# server can hold needs (32,768 tokens of text and tool schemas are well under 1 MiB).
MAX_BODY_BYTES = 8 * 1024 * 1024
# bodies past this count against OpenAIServer.max_large_bodies (read, parsed and tokenized a few
# at a time)
LARGE_BODY_BYTES = 1 << 20

SHUTDOWN_GRACE_S = 10.0

# Fault-injection hook: sees the decoded body; returns None to proceed, or (status, body, headers).
Middleware = Callable[[Any], Awaitable["tuple[int, Any, dict[str, str]] | None"]]


async def _send_cut(request: web.Request, status: int, cut: CutBody, headers: dict[str, str]) -> web.StreamResponse:
    """Send `cut.data` under a Content-Length of `cut.claimed`, then drop the connection."""
    resp = web.StreamResponse(status=status, headers={**headers, "Content-Type": "application/json",
                                                      "Content-Length": str(cut.claimed)})
    await resp.prepare(request)
    await resp.write(cut.data)
    if request.transport is not None:
        request.transport.close()
    return resp


def _exit_now(why: str) -> None:
    """End the process now (exit 1) without the interpreter's shutdown, which with the device
    runtime's threads still busy ends in std::terminate (SIGABRT)."""
    import os
    import sys

    print(f"actionopd serve: {why}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


@dataclass(frozen=True)
class CutBody:
    """A reply a middleware wants cut short: the headers promise `claimed` bytes, `data` (fewer)
    are sent, then the connection is dropped, as a proxy or a provider's load balancer that
    resets mid-reply does (serve/faults.py "reset_mid_body")."""
    data: bytes
    claimed: int


class OpenAIServer:
    """`POST /v1/chat/completions` and `GET /v1/models` over one or more backends.

    Binds 127.0.0.1 by default. With `api_key_env`, requests must carry
    `Authorization: Bearer $<that variable>`; the key itself is read once and never logged.
    """

    def __init__(
        self,
        backends: Backend | list[Backend],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key_env: str | None = None,
        middleware: Middleware | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_large_bodies: int = 2,
        shutdown_grace_s: float = SHUTDOWN_GRACE_S,
    ):
        backends = backends if isinstance(backends, list) else [backends]
        if not backends:
            raise ValueError("OpenAIServer needs at least one backend")
        self.backends = {b.model_name: b for b in backends}
        self.host, self.port = host, port
        self.middleware = middleware
        self.max_body_bytes = int(max_body_bytes)
        self.shutdown_grace_s = float(shutdown_grace_s)  # requests in flight at a stop get this long
        # at most this many bodies over LARGE_BODY_BYTES (or of unknown size) are read, parsed and
        # (by a model backend) rendered and tokenized at once (requests.release_body_slot); the
        # others wait unread in their sockets, so a handful of clients sending near-limit bodies
        # cannot multiply the server's memory (issues 34, 46)
        self.max_large_bodies = max(1, int(max_large_bodies))
        self.large_bodies_waiting = 0
        self._large_bodies: asyncio.Semaphore | None = None  # made on the server's loop
        self._api_key: str | None = None
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"api_key_env={api_key_env!r} is set but that environment variable is empty or unset")
            self._api_key = key
        self.request_count = 0  # completion requests that reached a backend (tests count HTTP calls)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._grace_over: asyncio.Event | None = None
        self.base_url: str | None = None

    # --- app -------------------------------------------------------------------------------
    def _app(self) -> web.Application:
        # one byte more than the limit, so that _json_body (not aiohttp's plain-text 413) refuses
        app = web.Application(client_max_size=self.max_body_bytes + 1, middlewares=[_json_http_errors])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)  # token scoring (serve/scoring.py)
        app.router.add_get("/v1/models", self._models)
        return app

    def _auth_error(self, request: web.Request) -> web.Response | None:
        if self._api_key is None:
            return None
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self._api_key}".encode()):
            err = RequestError(401, "missing or wrong bearer token", "authentication_error", "invalid_api_key")
            return web.json_response(err.body(), status=401)
        return None

    async def _json_body(self, request: web.Request) -> tuple[Any, web.Response | None]:
        """(the request's JSON body, None), or (None, the error response to send instead): 401
        for a missing/wrong bearer token, 400 for a body that is not JSON. One gate for every
        POST route, so they authenticate and reject bad bodies alike."""
        if (denied := self._auth_error(request)) is not None:
            return None, denied
        if (request.content_length or 0) > self.max_body_bytes:  # refused before it is parsed
            return None, await self._too_large(request, request.content_length)
        size = request.content_length
        if size is not None and size <= LARGE_BODY_BYTES:
            return await self._read_json(request)
        if self._large_bodies is None:
            self._large_bodies = asyncio.Semaphore(self.max_large_bodies)
        self.large_bodies_waiting += 1
        try:
            await self._large_bodies.acquire()
        finally:
            self.large_bodies_waiting -= 1
        slot, held = self._large_bodies, [True]

        def release() -> None:   # once, whoever calls it first (the backend or the request's end)
            if held:
                held.clear()
                slot.release()

        hold_body_slot(release)   # held past the parse, until the backend has tokenized the prompt
        body, rejected = await self._read_json(request)
        if rejected is not None:
            release()
        return body, rejected

    async def _read_json(self, request: web.Request) -> tuple[Any, web.Response | None]:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body without Content-Length
            return None, await self._too_large(request, None)
        try:  # a large body decodes off the event loop: other clients keep being answered
            return (json.loads(raw) if len(raw) < 65536 else await asyncio.to_thread(json.loads, raw)), None
        except (ValueError, UnicodeDecodeError) as e:
            return None, web.json_response(RequestError(400, f"request body is not valid JSON: {e}").body(), status=400)
        except RecursionError:   # e.g. 100,000 nested arrays: a 400 in JSON, not aiohttp's plain-text 500
            return None, web.json_response(RequestError(
                400, "request body nests arrays/objects too deeply to parse (Python's JSON parser stops near "
                     f"{sys.getrecursionlimit():,} levels); send a flatter body", code="json_too_deep").body(),
                status=400)

    async def _too_large(self, request: web.Request, size: int | None) -> web.Response:
        # a chunked upload has no Content-Length: what is known is that it passed the limit
        got = f"{size:,} bytes" if size is not None else "a chunked upload (no Content-Length) that passed it"
        err = RequestError(413, f"request body too large: the limit is {self.max_body_bytes:,} bytes "
                                f"(actionopd serve --max-body-mb), got {got}; shorten the conversation",
                           code="request_too_large")
        # the rest of the body is read and dropped chunk by chunk (no memory, the loop stays free):
        # a client still sending when the connection closed would see a reset, not this answer
        async for _ in request.content.iter_chunked(1 << 20):
            pass
        return web.json_response(err.body(), status=413)

    async def _models(self, request: web.Request) -> web.Response:
        if (denied := self._auth_error(request)) is not None:
            return denied
        # a checkpoint's backend also says what it serves: the step, and the unreadable step a
        # fallback skipped (issue 34: after a fallback nothing said which step answered)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "actionopd_jax",
                 **({"actionopd_source": b.source} if getattr(b, "source", None) else {})}
                for name, b in self.backends.items()]
        return web.json_response({"object": "list", "data": data})

    async def _chat(self, request: web.Request) -> web.Response:
        body, rejected = await self._json_body(request)
        if rejected is not None:
            return rejected
        if self.middleware is not None:
            injected = await self.middleware(body)
            if injected is not None:
                status, payload, headers = injected
                if isinstance(payload, CutBody):
                    return await _send_cut(request, status, payload, headers)
                if isinstance(payload, (dict, list)):
                    return web.json_response(payload, status=status, headers=headers)
                return web.Response(body=payload, status=status, headers=headers, content_type="application/json")
        try:
            req = ChatRequest.from_json(body)
            backend = self.backends.get(req.model)
            if backend is None:
                raise RequestError(404, f"model {req.model!r} not found; served: {sorted(self.backends)}",
                                   code="model_not_found")
            self.request_count += 1
            if req.stream and getattr(backend, "streams_live", False):
                # tokens are sent as they are generated; a request the backend cannot take
                # fails here, as an HTTP error, before the stream starts
                prompt_tokens, events = await backend.stream(req)
            else:
                events = None
                choices, prompt_tokens = await backend.complete(req)
                body = completion_body(req, choices, prompt_tokens)
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP error below
            return _error_response(e)
        if req.stream:
            from actionopd_jax.serve.streaming import send_live_stream, send_stream

            if events is not None:
                return await send_live_stream(request, req, prompt_tokens, events, stop=self._grace_over)
            return await send_stream(request, body, include_usage=req.include_usage)
        return web.json_response(body)

    async def _completions(self, request: web.Request) -> web.Response:
        """vLLM-style prompt scoring: token-id prompt, echo, max_tokens 0 (see serve/scoring.py)."""
        from actionopd_jax.serve.scoring import handle_completion

        body, rejected = await self._json_body(request)
        if rejected is not None:
            return rejected
        try:
            payload = await handle_completion(body, self.backends)
            self.request_count += 1
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP error below
            return _error_response(e)
        return web.json_response(payload)

    # --- lifecycle -------------------------------------------------------------------------
    async def _start_site(self) -> None:
        # set when a stop's grace has run out: streams still running end with an error event
        # saying so (streaming.py), before aiohttp closes their connections
        self._grace_over = asyncio.Event()
        # handler_cancellation: a client that disconnects cancels its handler, and with it its
        # queued or segmented generation (sampling/batching.py), instead of leaving it running
        # shutdown_timeout: on stop, requests in flight get that long to finish, then are cancelled
        self._runner = web.AppRunner(self._app(), access_log=None, handler_cancellation=True,
                                     shutdown_timeout=self.shutdown_grace_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.port = port
        self.base_url = f"http://{host}:{port}/v1"

    async def _shutdown(self) -> None:
        """aiohttp's cleanup (no new connections; requests in flight get shutdown_grace_s), then
        whatever is still running is cancelled: aiohttp alone let a request that never ends
        hold the shutdown past twice its grace (issue 34)."""
        cleanup = asyncio.ensure_future(self._runner.cleanup())
        try:
            await asyncio.wait_for(asyncio.shield(cleanup), self.shutdown_grace_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._grace_over.set()   # the streams left end now, each with a terminal event
            try:   # a second for them to write it; then what still runs is cancelled below
                await asyncio.wait_for(cleanup, 1.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        me = asyncio.current_task()
        left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    def start(self) -> str:
        """Start in a background thread; returns the base URL (`http://127.0.0.1:PORT/v1`)."""
        if self._thread is not None:
            assert self.base_url is not None
            return self.base_url
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start_site())
            except BaseException as e:  # noqa: BLE001 - reported to the caller of start()
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name="openai-http", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread = None
            raise RuntimeError(f"could not start server on {self.host}:{self.port}: {failure[0]}") from failure[0]
        assert self.base_url is not None
        return self.base_url

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self.shutdown_grace_s + 10)
        self._thread = None

    def serve_forever(self) -> None:
        """Blocking run for the CLI. Ctrl-C or SIGTERM stops it cleanly: no new connections,
        requests in flight get shutdown_grace_s to finish, then are cancelled, and the process
        exits 0. A second signal during that changes nothing (it is acknowledged: issue 34 saw
        one abort the process, exit 134). A shutdown that still outlasts its limit ends the
        process at once (exit 1), never through the interpreter's own exit with device threads
        running, which is what aborted."""
        import signal

        stop = threading.Event()

        def on_signal(signum, _frame):
            if stop.is_set():
                print(f"{signal.Signals(signum).name} again: already shutting down; requests in flight end within "
                      f"{self.shutdown_grace_s:g} s", flush=True)
                return
            stop.set()

        previous = signal.signal(signal.SIGTERM, on_signal)
        previous_int = signal.signal(signal.SIGINT, on_signal)
        self.start()
        print(f"serving {sorted(self.backends)} at {self.base_url}", flush=True)
        try:
            assert self._thread is not None
            while self._thread.is_alive() and not stop.wait(0.5):
                pass
        finally:
            stop.set()
            print(f"shutting down: requests in flight get {self.shutdown_grace_s:g} s to finish, then are cancelled",
                  flush=True)
            thread = self._thread
            self.stop()
            if thread is not None and thread.is_alive():
                _exit_now("shutdown outlasted its limit: exiting with requests still running")
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)

    def __enter__(self) -> "OpenAIServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
