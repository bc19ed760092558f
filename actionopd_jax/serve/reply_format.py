"""A generated reply as OpenAI message fields: content, tool_calls, reasoning_content.

Like vLLM's hermes tool parser: `<tool_call>` blocks become structured `tool_calls` when
every block is a JSON object with a string name and object arguments; otherwise the visible
text is returned as content with the blocks left in it, so a client that parses content
(`chat.action_from_openai_message`) still sees what the model wrote and can call it invalid.
The server never validates arguments against schemas: that is the client's rule to apply.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from actionopd_jax.chat.actions import decode_json
from actionopd_jax.chat.reply import replace_lone_surrogates, split_reasoning, split_reply, strip_end_markers


def _tool_call(value: Any) -> dict[str, Any] | None:
    if not (isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"]
            and isinstance(value.get("arguments"), dict)):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(value["arguments"], ensure_ascii=False, allow_nan=False)}}


def message_fields(text: str, *, parse_tools: bool) -> tuple[str | None, list[dict] | None, str | None]:
    """(content, tool_calls, reasoning_content) of one raw reply."""
    text = strip_end_markers(replace_lone_surrogates(text))
    reasoning, visible, error = split_reasoning(text)
    if error:  # cut off inside <think>: nothing visible yet; keep the raw text for the client
        return text.strip(), None, None
    reasoning_out = reasoning or None
    if parse_tools:
        parts = split_reply(visible)
        if parts.error is None and parts.call_bodies:
            calls = []
            for body in parts.call_bodies:
                value, problem = decode_json(body.strip())
                call = None if problem else _tool_call(value)
                if call is None:
                    calls = None
                    break
                calls.append(call)
            if calls:
                return (parts.text or None), calls, reasoning_out
    return visible.strip(), None, reasoning_out
