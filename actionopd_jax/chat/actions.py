"""Parse one model reply into exactly one action: ToolCall, Message or Invalid.

Rules (paper section 2 and appendix A.2): reasoning (`<think>`) is never part of the action;
a student reply with more than one tool call violates the single-action protocol (Invalid);
a teacher reply keeps only its first tool call. Evaluation alone reads a reply the way the
benchmarks' own runners do (`parallel=True`): N tool calls are one `ToolCalls`, all run. A tool call needs a JSON object body with a
string `name` of a known tool and an object `arguments` satisfying that tool's schema.
Model output is untrusted: it is only ever decoded as JSON (never evaluated), with bounds on
nesting, and nothing it contains can raise out of these functions.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Sequence

from actionopd_jax.chat.reply import has_lone_surrogate, replace_lone_surrogates, split_reply
from actionopd_jax.chat.schema import validate_arguments
from actionopd_jax.types import Action, ChatMessage, Invalid, Message, Reply, ToolCall, ToolCalls, ToolSchema

Role = Literal["student", "teacher"]

# Real tool arguments nest a handful of levels; the bound keeps every later recursive walk
# (validation, canonical matching, hashing) far from Python's recursion limit.
MAX_JSON_DEPTH = 64
_REASON_CHARS = 300


class _DuplicateKey(ValueError):
    pass


def _short(text: str, limit: int = _REASON_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(f"duplicate key {_short(key, 60)!r}")
            seen.add(key)
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    # json.loads turns an out-of-range literal such as 1e999 into inf, which json.dumps would
    # then write back as the non-JSON token Infinity: refuse it like NaN / Infinity.
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {_short(text, 40)} is out of range (not a finite float)")
    return value


def _json_problem(value: Any) -> str | None:
    """Iterative walk: nesting bound and unpaired surrogates (from \\ud800-style escapes)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"nested deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(node, dict):
            for key, item in node.items():
                if has_lone_surrogate(key):
                    return "contains invalid unicode (an unpaired surrogate escape)"
                stack.append((item, depth + 1))
        elif isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, str) and has_lone_surrogate(node):
            return "contains invalid unicode (an unpaired surrogate escape)"
    return None


def decode_json(text: str) -> tuple[Any, str | None]:
    """Strict JSON decode of untrusted text: (value, None) or (None, reason). Rejects NaN /
    Infinity, duplicate keys, excessive nesting and unpaired surrogates."""
    try:
        value = json.loads(text, object_pairs_hook=_object_without_duplicates, parse_constant=_reject_constant,
                           parse_float=_finite_float)
    except RecursionError:
        return None, f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
    except json.JSONDecodeError as err:
        return None, f"not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
    except ValueError as err:  # duplicate keys, NaN, 1e999, integers beyond Python's digit limit
        return None, f"not valid JSON ({_short(str(err), 120)})"
    problem = _json_problem(value)
    if problem:
        return None, f"JSON {problem}"
    return value, None


def tool_parameters(tools: Sequence[ToolSchema] | None) -> dict[str, Any]:
    """Map tool name -> its parameters schema (None when a tool declares none). Accepts OpenAI
    function tools ({"type": "function", "function": {...}}) and bare function dicts."""
    index: dict[str, Any] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool schema needs function.name (a string), got {_short(repr(tool), 120)}")
        index.setdefault(fn["name"], fn.get("parameters"))
    return index


def check_tool_call(name: Any, arguments: Any, tools: Sequence[ToolSchema] | None) -> Action:
    """ToolCall if `name` is a known tool and `arguments` an object valid for its schema."""
    if not isinstance(name, str) or not name.strip():
        return Invalid("tool call has no function name")
    if not isinstance(arguments, dict):
        return Invalid(f"arguments of {_short(name, 80)!r} must be a JSON object, got {type(arguments).__name__}")
    index = tool_parameters(tools)
    if name not in index:
        known = ", ".join(sorted(index)[:20]) or "none"
        return Invalid(f"unknown tool {_short(name, 80)!r} (available: {_short(known, 200)})")
    reason = validate_arguments(arguments, index[name])
    if reason:
        return Invalid(f"arguments of {name!r} violate its schema: {_short(reason)}")
    return ToolCall(name=name, arguments=arguments)


def _call_from_body(body: str, tools: Sequence[ToolSchema] | None) -> Action:
    value, problem = decode_json(body.strip())
    if problem:
        return Invalid(f"tool call is {problem}" if problem.startswith("not") else f"tool call {problem}")
    if not isinstance(value, dict):
        return Invalid(f"tool call must be a JSON object with name and arguments, got {type(value).__name__}")
    if "name" not in value:
        return Invalid("tool call has no function name")
    if "arguments" not in value:
        return Invalid(f"tool call {_short(str(value['name']), 80)!r} has no arguments object")
    return check_tool_call(value["name"], value["arguments"], tools)


def _all_calls(actions: list[Action]) -> Reply:
    """One reply's several calls: all valid -> ToolCalls; else the first problem, numbered
    (a reply is one answer: it is not run in part, as one bad call alone is not run)."""
    for k, action in enumerate(actions):
        if isinstance(action, Invalid):
            return Invalid(f"tool call {k + 1} of {len(actions)}: {action.reason}")
    return ToolCalls(calls=tuple(actions))  # type: ignore[arg-type]


def _parse(text: Any, tools: Sequence[ToolSchema] | None, role: Role, parallel: bool = False) -> Reply:
    if not isinstance(text, str):
        return Invalid(f"reply must be text, got {type(text).__name__}")
    parts = split_reply(text, max_calls=None if parallel else 2 if role == "student" else 1)
    if parts.error:
        return Invalid(parts.error)
    if len(parts.call_bodies) > 1 and parallel:
        return _all_calls([_call_from_body(body, tools) for body in parts.call_bodies])
    if len(parts.call_bodies) > 1:
        return Invalid("more than one tool call in one reply (the student must take a single action)")
    if parts.call_bodies:
        return _call_from_body(parts.call_bodies[0], tools)
    if not parts.text:
        return Invalid("empty reply (no text and no tool call)")
    return Message(text=parts.text)


def parse_student(text: str, tools: Sequence[ToolSchema] | None) -> Action:
    """Student reply -> action. Several tool calls, bad JSON, an unknown tool or a schema
    violation -> Invalid; no tool call -> Message with the reasoning removed."""
    return _parse(text, tools, "student")


def parse_teacher(text: str, tools: Sequence[ToolSchema] | None) -> Action:
    """Teacher reply -> action; of several tool calls only the first is kept (and judged)."""
    return _parse(text, tools, "teacher")


def _message_text(content: Any) -> str | None:
    """OpenAI message content (string, null or list of parts) as text; None if malformed."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return "".join(texts)
    return None


def action_from_openai_message(msg: Any, tools: Sequence[ToolSchema] | None, *, role: Role,
                               parallel: bool = False) -> Reply:
    """Action of an OpenAI chat-completion message (dict, or an SDK object with model_dump).
    Structured `tool_calls` win; otherwise the content is parsed as text (servers without a
    tool parser return `<tool_call>` blocks inside the content). `parallel` (evaluation
    only, native function calling): a reply with N > 1 calls is one `ToolCalls`; without it
    the student's single-action rule makes it Invalid."""
    if role not in ("student", "teacher"):
        raise ValueError(f"role must be 'student' or 'teacher', got {role!r}")
    if hasattr(msg, "model_dump") and not isinstance(msg, dict):
        msg = msg.model_dump()
    if not isinstance(msg, dict):
        return Invalid(f"message must be an object, got {type(msg).__name__}")
    calls = msg.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            return Invalid("tool_calls must be a list")
        if len(calls) > 1 and parallel:
            return _all_calls([_structured_call(call, tools) for call in calls])
        if role == "student" and len(calls) > 1:
            return Invalid("more than one tool call in one reply (the student must take a single action)")
        return _structured_call(calls[0], tools)
    text = _message_text(msg.get("content"))
    if text is None:
        return Invalid(f"message content must be text, got {type(msg.get('content')).__name__}")
    return _parse(text, tools, role, parallel)


def _structured_call(call: Any, tools: Sequence[ToolSchema] | None) -> Action:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return Invalid("tool call has no function object")
    if call.get("type", "function") != "function":
        return Invalid(f"unsupported tool call type {_short(str(call.get('type')), 40)!r}")
    name, raw = fn.get("name"), fn.get("arguments")
    if isinstance(name, str):
        name = replace_lone_surrogates(name)
    if isinstance(raw, str):
        # Providers encode "no arguments" as "" or "{}"; anything else must be a JSON object.
        if not raw.strip():
            raw = "{}"
        arguments, problem = decode_json(replace_lone_surrogates(raw))
        if problem:
            return Invalid(f"arguments are {problem}" if problem.startswith("not") else f"arguments {problem}")
    elif isinstance(raw, dict):
        problem = _json_problem(raw)
        if problem:
            return Invalid(f"arguments {problem}")
        arguments = raw
    elif raw is None:
        return Invalid("tool call has no arguments")
    else:
        return Invalid(f"arguments must be a JSON object, got {type(raw).__name__}")
    return check_tool_call(name, arguments, tools)


def _arguments_text(arguments: dict[str, Any]) -> str:
    # Parsed arguments are plain JSON; a value that is not (only possible from Python callers)
    # is shown by its type name rather than failing to record the turn.
    return json.dumps(arguments, ensure_ascii=False, default=lambda o: f"<{type(o).__name__}>")


def calls_to_assistant_message(calls: Sequence[ToolCall], call_ids: Sequence[str]) -> ChatMessage:
    """The one assistant message of a reply that made `calls` (one or several, in order), the
    i-th linked to its tool result by `call_ids[i]`."""
    if len(calls) != len(call_ids) or not calls:
        raise ValueError(f"need one call id per tool call, got {len(call_ids)} ids for {len(calls)} calls")
    if len(set(call_ids)) != len(call_ids) or not all(isinstance(i, str) and i for i in call_ids):
        raise ValueError("call ids must be distinct non-empty strings (each links one tool result to its call)")
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": call.name, "arguments": _arguments_text(call.arguments)}}
            for call, call_id in zip(calls, call_ids)
        ],
    }


def action_to_assistant_message(action: ToolCall | Message, *, call_id: str) -> ChatMessage:
    """The assistant message that records a committed action in the conversation history."""
    if isinstance(action, ToolCall):
        if not isinstance(call_id, str) or not call_id:
            raise ValueError("call_id must be a non-empty string (it links the tool result to the call)")
        return calls_to_assistant_message([action], [call_id])
    if isinstance(action, Message):
        return {"role": "assistant", "content": action.text}
    if isinstance(action, Invalid):
        raise ValueError(f"an Invalid action is never committed to the conversation ({action.reason})")
    raise TypeError(f"expected ToolCall or Message, got {type(action).__name__}")
