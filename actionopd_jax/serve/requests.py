"""The OpenAI protocol's request and response types, apart from the HTTP server: what a
`Backend` receives (`ChatRequest`), returns (`ChatChoice`) and raises (`RequestError`), and the
chat completion body. Backends, the scoring route and the server all import them from here, so
the server (openai_http.py) and the scoring route (scoring.py) do not import each other."""

from __future__ import annotations

import contextvars
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

log = logging.getLogger(__name__)


# The server's slot for a large body (OpenAIServer.max_large_bodies), set in the request's
# context: taken before the body is read and given back once the backend has tokenized its
# prompt (or at the end of the request), so the bound covers the costly part. Given back after
# the read alone, it let three 7.5 MB bodies tokenize at once (issue 46: +3.9 GB).
_BODY_SLOT: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("body_slot", default=None)


def hold_body_slot(release: Callable[[], None]) -> None:
    """The server: this request holds a large-body slot; `release` gives it back (once)."""
    _BODY_SLOT.set(release)


def release_body_slot() -> None:
    """Give back the request's large-body slot, if it holds one: a backend calls this once the
    prompt is tokenized; the server calls it again when the request ends (a no-op by then)."""
    release = _BODY_SLOT.get()
    if release is not None:
        _BODY_SLOT.set(None)
        release()


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
    # None / "auto" / "none" / "required", or the name of the one function the reply must call
    tool_choice: str | None = None
    forced_tool: str | None = None
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
    # OpenAI's `parallel_tool_calls`: false = at most one call a reply (the first is kept, as
    # vLLM does; the paper's single-action protocol, A.3, reads a reply the same way)
    parallel_tool_calls: bool = True
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
            for j, part in enumerate(content if isinstance(content, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(400, f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': "
                                            f"...}}) are served, got type {kind!r}: the model reads text alone")
        for legacy in ("functions", "function_call"):
            if legacy in body:
                raise RequestError(400, f"'{legacy}' (OpenAI's deprecated function calling) is not served; send "
                                        "'tools' and 'tool_choice'")
        _note_ignored(body)
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list) or not all(
                isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
                for t in tools
            ):
                raise RequestError(400, "'tools' must be a list of {type: function, function: {name, parameters}}")
        tool_choice = _tool_choice(body.get("tool_choice"), tools or None)
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
        _refuse_unapplied(body)
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool) and parallel is not None:
            raise RequestError(400, "'parallel_tool_calls' must be true or false")
        top_logprobs = _number(body, "top_logprobs", int, 0, lo=0, hi=20)
        if top_logprobs and not body.get("logprobs"):
            raise RequestError(400, "'top_logprobs' needs 'logprobs': true")
        return cls(
            model=model,
            messages=messages,
            tools=tools or None,
            tool_choice=tool_choice[0],
            forced_tool=tool_choice[1],
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
            parallel_tool_calls=parallel is not False,
            raw=body,
        )


def _tool_choice(value: Any, tools: list[dict] | None) -> tuple[str | None, str | None]:
    """(mode, forced function name) of a request's `tool_choice`, as OpenAI defines it: "none"
    forbids calls, "auto" lets the model choose, "required" forces a call to one of `tools`,
    {"type": "function", "function": {"name": X}} forces a call to X (mode "required"). A
    tool_choice without tools, or forcing a tool that is not offered, is a 400."""
    if value is None:
        return None, None
    if not tools:
        raise RequestError(400, "'tool_choice' is only allowed when 'tools' are given: offer the tools, "
                                "or leave 'tool_choice' out")
    if value in ("auto", "none", "required"):
        return value, None
    name = value.get("function", {}).get("name") if isinstance(value, dict) and isinstance(
        value.get("function"), dict) else None
    if not isinstance(value, dict) or value.get("type", "function") != "function" or not isinstance(name, str):
        raise RequestError(400, "'tool_choice' must be 'auto', 'none', 'required' or "
                                "{'type': 'function', 'function': {'name': NAME}}")
    offered = [t["function"]["name"] for t in tools]
    if name not in offered:
        raise RequestError(400, f"'tool_choice' forces function {name!r}, which is not among the offered "
                                f"'tools' {offered}; offer it or name one of them")
    return "required", name


# what a chat request may carry; other top-level fields are ignored, each logged once
KNOWN_FIELDS = frozenset((
    "model", "messages", "tools", "tool_choice", "n", "temperature", "top_p", "top_k", "max_tokens",
    "max_completion_tokens", "seed", "stop", "logprobs", "top_logprobs", "stream", "stream_options",
    "frequency_penalty", "presence_penalty", "response_format", "chat_template_kwargs", "parallel_tool_calls",
    # sent by SDKs and harnesses; nothing to apply here (`user` names the task for serve's
    # per-task limits, serve/task_limits.py)
    "user", "metadata", "store"))
_IGNORED_SEEN: set[str] = set()


def _note_ignored(body: dict) -> None:
    """Fields this server does not know are ignored (harnesses send vendor extras), each named
    once in the log so an operator can see what their client sends and we do not apply."""
    for key in sorted(set(body) - KNOWN_FIELDS - _IGNORED_SEEN):
        _IGNORED_SEEN.add(key)
        log.warning("chat request field %r is not applied by this server (ignored; logged once)", key)


def _refuse_unapplied(body: dict) -> None:
    """Settings our sampler does not apply are accepted only at their neutral values (AppWorld
    sends penalties of 0 and a text response_format); anything else is a 400, not a silent
    no-op that would make a harness's numbers mean something other than they say."""
    for key in ("frequency_penalty", "presence_penalty"):
        if _number(body, key, float, 0.0, lo=-2.0, hi=2.0) != 0.0:
            raise RequestError(400, f"'{key}' is not applied by this server; send 0 or leave it out")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError(400, "'response_format' other than {'type': 'text'} is not applied by this server "
                                "(no constrained decoding); leave it out")
    if body.get("logit_bias"):
        raise RequestError(400, "'logit_bias' is not applied by this server; leave it out")


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


def serial_calls(req: ChatRequest, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tool calls a reply may return: all of them, or only the first where the request
    said `parallel_tool_calls: false`."""
    return calls[:1] if calls and not req.parallel_tool_calls else calls


def completion_body(req: ChatRequest, choices: list[ChatChoice], prompt_tokens: int) -> dict[str, Any]:
    out = []
    for i, ch in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": ch.content}
        if ch.tool_calls:
            message["tool_calls"] = serial_calls(req, ch.tool_calls)
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
