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
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from aiohttp import web

MAX_BODY_BYTES = 32 * 1024 * 1024


class RequestError(Exception):
    """A 4xx the client caused. Backends raise it for e.g. a context that is too long."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a final usage-only chunk
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Any) -> "ChatRequest":
        """Validate a decoded JSON body; every problem is a 400 that names the field."""
        model = requested_model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' is required and must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise RequestError(400, f"messages[{i}] must be an object with role system/user/assistant/tool")
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise RequestError(400, f"messages[{i}].content must be a string, a list of parts, or null")
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list) or not all(
                isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
                for t in tools
            ):
                raise RequestError(400, "'tools' must be a list of {type: function, function: {name, parameters}}")
        tool_choice = body.get("tool_choice")
        if tool_choice is not None and tool_choice not in ("auto", "none", "required") and not isinstance(tool_choice, dict):
            raise RequestError(400, "'tool_choice' must be 'auto', 'none', 'required' or a function object")
        if isinstance(tool_choice, dict):
            tool_choice = "auto"  # forcing one named function is not supported; treated as auto
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
            raise RequestError(400, "'stop' must be a string or a list of strings")
        stream = body.get("stream") or False
        options = body.get("stream_options")
        if not isinstance(stream, bool) or (options is not None and not isinstance(options, dict)):
            raise RequestError(400, "'stream' must be a boolean and 'stream_options' an object")
        if options is not None and not stream:
            raise RequestError(400, "'stream_options' is only allowed with 'stream': true")
        top_logprobs = _number(body, "top_logprobs", int, 0, lo=0, hi=20)
        if top_logprobs and not body.get("logprobs"):
            raise RequestError(400, "'top_logprobs' needs 'logprobs': true")
        return cls(
            model=model,
            messages=messages,
            tools=tools or None,
            tool_choice=tool_choice,
            n=_number(body, "n", int, 1, lo=1, hi=64),
            temperature=_number(body, "temperature", float, 1.0, lo=0.0, hi=5.0),
            top_p=_number(body, "top_p", float, 1.0, lo=0.0, hi=1.0),
            top_k=_number(body, "top_k", int, 0, lo=0, hi=1_000_000),
            max_tokens=_number(body, "max_tokens", int, None, lo=1, hi=1_000_000)
            if body.get("max_tokens") is not None
            else _number(body, "max_completion_tokens", int, None, lo=1, hi=1_000_000),
            seed=_number(body, "seed", int, None, lo=-(2**63), hi=2**63 - 1),
            stop=stop,
            logprobs=bool(body.get("logprobs") or False),
            top_logprobs=top_logprobs,
            stream=stream,
            include_usage=bool((options or {}).get("include_usage")),
            raw=body,
        )


def requested_model(body: Any) -> str:
    """The 'model' of a decoded request body, or a 400 when the body is not an object or names
    no model. Shared by the chat and the scoring routes so both reject such bodies alike."""
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required and must be a non-empty string")
    return model


def _number(body: dict, key: str, kind: type, default, *, lo, hi):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise RequestError(400, f"'{key}' must be a{'n integer' if kind is int else ' number'}, got {value!r}")
    if not lo <= value <= hi:
        raise RequestError(400, f"'{key}' must be between {lo} and {hi}, got {value!r}")
    return kind(value)


@dataclass
class ChatChoice:
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    finish_reason: str = "stop"
    logprobs: list[dict[str, Any]] | None = None
    completion_tokens: int = 0


class Backend(Protocol):
    model_name: str

    async def complete(self, req: ChatRequest) -> tuple[list[ChatChoice], int]:
        """Return the choices and the prompt token count."""
        ...


# Fault-injection hook: sees the decoded body; returns None to proceed, or (status, body, headers).
Middleware = Callable[[Any], Awaitable["tuple[int, Any, dict[str, str]] | None"]]


def completion_body(req: ChatRequest, choices: list[ChatChoice], prompt_tokens: int) -> dict[str, Any]:
    out = []
    for i, ch in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": ch.content}
        if ch.tool_calls:
            message["tool_calls"] = ch.tool_calls
        if ch.reasoning_content:
            message["reasoning_content"] = ch.reasoning_content
        finish = "tool_calls" if ch.tool_calls and ch.finish_reason == "stop" else ch.finish_reason
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish}
        choice["logprobs"] = {"content": ch.logprobs} if (req.logprobs and ch.logprobs is not None) else None
        out.append(choice)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": out,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion},
    }


def _error_response(err: Exception) -> web.Response:
    """A route's failure as an HTTP error: a RequestError with its own status, anything else
    (a backend bug) as a 500 with a message, never a dropped connection."""
    if not isinstance(err, RequestError):
        err = RequestError(500, f"backend error: {type(err).__name__}: {err}", "server_error")
    return web.json_response(err.body(), status=err.status)


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
    ):
        backends = backends if isinstance(backends, list) else [backends]
        if not backends:
            raise ValueError("OpenAIServer needs at least one backend")
        self.backends = {b.model_name: b for b in backends}
        self.host, self.port = host, port
        self.middleware = middleware
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
        self.base_url: str | None = None

    # --- app -------------------------------------------------------------------------------
    def _app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
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
        try:
            return json.loads(await request.read()), None
        except (ValueError, UnicodeDecodeError) as e:
            return None, web.json_response(RequestError(400, f"request body is not valid JSON: {e}").body(), status=400)

    async def _models(self, request: web.Request) -> web.Response:
        if (denied := self._auth_error(request)) is not None:
            return denied
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "actionopd_jax"} for name in self.backends]
        return web.json_response({"object": "list", "data": data})

    async def _chat(self, request: web.Request) -> web.Response:
        body, rejected = await self._json_body(request)
        if rejected is not None:
            return rejected
        if self.middleware is not None:
            injected = await self.middleware(body)
            if injected is not None:
                status, payload, headers = injected
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
            choices, prompt_tokens = await backend.complete(req)
            body = completion_body(req, choices, prompt_tokens)
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP error below
            return _error_response(e)
        if req.stream:
            from actionopd_jax.serve.streaming import send_stream

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
        # handler_cancellation: a client that disconnects cancels its handler, and with it its
        # queued or segmented generation (serve/batching.py), instead of leaving it running
        self._runner = web.AppRunner(self._app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.port = port
        self.base_url = f"http://{host}:{port}/v1"

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
            loop.run_until_complete(self._runner.cleanup())
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
        self._thread.join(timeout=10)
        self._thread = None

    def serve_forever(self) -> None:
        """Blocking run for the CLI (Ctrl-C stops it)."""
        self.start()
        print(f"serving {sorted(self.backends)} at {self.base_url}", flush=True)
        try:
            assert self._thread is not None
            while self._thread.is_alive():
                self._thread.join(timeout=1.0)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def __enter__(self) -> "OpenAIServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
