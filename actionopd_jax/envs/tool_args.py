"""Checks on a tool call before any environment runs it.

Model output is untrusted. A tool call reaches an environment only if its name is one of the
tools offered at this state, is a plain public identifier, and its arguments are plain JSON
values of bounded size that satisfy the tool's JSON schema. Everything else becomes a tool
error message for the agent; nothing here ever evaluates text as code.
"""

from __future__ import annotations

import keyword
import math
import re
from typing import Any

from actionopd_jax.chat.schema import validate_arguments
from actionopd_jax.types import ToolCall, ToolSchema

# Limits sized far above anything a benchmark tool needs, far below what could hurt the host.
MAX_ARGUMENT_CHARS = 32_768  # total characters of all strings in the arguments
MAX_NESTING = 16
MAX_ITEMS = 4_096  # total list items and dict entries
MAX_ABS_INT = 2**63

_IDENTIFIER = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,127}$")


def is_safe_identifier(name: Any) -> bool:
    """A public Python identifier: no leading underscore (private/dunder), no keyword."""
    return isinstance(name, str) and bool(_IDENTIFIER.match(name)) and not keyword.iskeyword(name)


def tool_index(tools: list[ToolSchema]) -> dict[str, dict]:
    """Map tool name -> its `function` block."""
    return {t["function"]["name"]: t["function"] for t in tools}


def check_tool_call(call: ToolCall, tools: list[ToolSchema], *, check_types: bool = True) -> str | None:
    """None when `call` may run; otherwise a reason the agent can read and act on.

    With `check_types=False` only the call's shape is checked (tool name, plain bounded JSON,
    required and unknown parameter names), not value types or enums."""
    if not is_safe_identifier(call.name):
        return f"'{_clip(call.name)}' is not a valid tool name; call one of the listed tools."
    functions = tool_index(tools)
    if call.name not in functions:
        return f"Tool '{call.name}' is not available here. Available tools: {', '.join(sorted(functions))}."
    if not isinstance(call.arguments, dict):
        return "Tool arguments must be a JSON object mapping parameter names to values."
    budget = {"chars": 0, "items": 0}
    problem = _check_plain_json(call.arguments, "arguments", 0, budget)
    if problem:
        return problem
    params = functions[call.name].get("parameters") or {"type": "object", "properties": {}}
    for key in call.arguments:
        if not is_safe_identifier(key):
            return f"'{_clip(key)}' is not a valid parameter name for '{call.name}'."
    # The call may name only the tool's own parameters, whatever additionalProperties says:
    # they become Python keyword arguments.
    problem = _check_names(call.arguments, params, call.name)
    if problem or not check_types:
        return problem
    return validate_arguments(call.arguments, params)


def _check_names(arguments: dict, params: dict, tool: str) -> str | None:
    props = params.get("properties") or {}
    for name in params.get("required") or []:
        if name not in arguments:
            return f"arguments: missing required parameter '{name}' for '{tool}'."
    for name in arguments:
        if name not in props:
            return f"arguments: unknown parameter '{_clip(name, 40)}' for '{tool}'."
    return None


def _clip(text: Any, limit: int = 60) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_plain_json(value: Any, path: str, depth: int, budget: dict) -> str | None:
    """Only str/int/finite float/bool/None/list/dict-with-str-keys, within the size limits."""
    if depth > MAX_NESTING:
        return f"{path}: nested deeper than {MAX_NESTING} levels."
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        if abs(value) >= MAX_ABS_INT:
            return f"{path}: integer out of range (|x| must be below 2**63)."
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path}: numbers must be finite (no NaN or Infinity)."
    if isinstance(value, str):
        budget["chars"] += len(value)
        if budget["chars"] > MAX_ARGUMENT_CHARS:
            return f"arguments too large (more than {MAX_ARGUMENT_CHARS} characters of text)."
        return None
    if isinstance(value, list):
        budget["items"] += len(value)
        if budget["items"] > MAX_ITEMS:
            return f"arguments too large (more than {MAX_ITEMS} list items and object entries)."
        for i, item in enumerate(value):
            problem = _check_plain_json(item, f"{path}[{i}]", depth + 1, budget)
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        budget["items"] += len(value)
        if budget["items"] > MAX_ITEMS:
            return f"arguments too large (more than {MAX_ITEMS} list items and object entries)."
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path}: object keys must be strings."
            budget["chars"] += len(key)
            problem = _check_plain_json(item, f"{path}.{_clip(key, 30)}", depth + 1, budget)
            if problem:
                return problem
        return None
    return f"{path}: {type(value).__name__} is not a JSON value."
