"""MCP data <-> ours: a listed tool -> our ToolSchema (an OpenAI function tool, types.py), a
tools/call result -> the text of the tool message, and a tool's matcher evidence."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from actionopd_jax.types import ToolSchema

MAX_RESULT_CHARS = 20000  # one tool message; a longer result is cut (it is prompt context)


def tool_schema(tool: Any) -> ToolSchema:
    """An MCP `Tool` (name, description, inputSchema) as the function tool prompts show."""
    params = dict(tool.input_schema or {})
    params.setdefault("type", "object")
    params.setdefault("properties", {})
    description = tool.description or tool.title or ""
    return {"type": "function", "function": {"name": tool.name, "description": description, "parameters": params}}


def tool_evidence(schema: ToolSchema, source: str | None = None) -> str:
    """What the judge reads about one tool (paper A.3): description and input schema, and the
    implementation's source when the environment ships it."""
    fn = schema["function"]
    text = f"# MCP tool {fn['name']}\n# description: {fn.get('description', '')}\n" \
           f"# input schema:\n{json.dumps(fn.get('parameters', {}), indent=1, sort_keys=True)}"
    if source:
        text += f"\n# implementation:\n{source}"
    return text


@dataclass(frozen=True)
class ToolResult:
    text: str
    is_error: bool
    structured: Any = None


def tool_result(result: Any) -> ToolResult:
    """A `CallToolResult` as one message text: its text blocks joined; other blocks named by
    kind; the structured content as JSON when there is no text; `isError` kept."""
    parts = []
    for block in result.content or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and getattr(getattr(block, "resource", None), "text", None) is not None:
            parts.append(block.resource.text)
        else:
            parts.append(f"[{kind or 'content'} {getattr(block, 'mime_type', '') or ''}]".replace(" ]", "]"))
    structured = result.structured_content
    if not parts and structured is not None:
        parts.append(json.dumps(structured, sort_keys=True, default=str))
    text = "\n".join(parts)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + "\n[... cut]"
    is_error = bool(result.is_error)
    if is_error and not text.lower().startswith("error"):
        text = f"Error: {text}"
    return ToolResult(text=text, is_error=is_error, structured=structured)
