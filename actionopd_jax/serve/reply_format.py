"""A generated reply as OpenAI message fields: content, tool_calls, reasoning_content.

Like vLLM's hermes tool parser: `<tool_call>` blocks become structured `tool_calls` when
every block is a JSON object with a string name and object arguments; otherwise the visible
text is returned as content with the blocks left in it, so a client that parses content
(`chat.action_from_openai_message`) still sees what the model wrote and can call it invalid.
The server never validates arguments against schemas: that is the client's rule to apply, but
it never returns a structured call to a tool the request did not offer (such blocks stay in
the content, where the client's parser sees the unknown name).
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


def message_fields(text: str, *, parse_tools: bool, offered: set[str] | None = None
                   ) -> tuple[str | None, list[dict] | None, str | None]:
    """(content, tool_calls, reasoning_content) of one raw reply; `offered`: the tool names a
    structured call may name (None: any)."""
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
                if call is None or (offered is not None and call["function"]["name"] not in offered):
                    calls = None
                    break
                calls.append(call)
            if calls:
                return (parts.text or None), calls, reasoning_out
    return visible.strip(), None, reasoning_out


def forced_call_prefix(name: str) -> str:
    """The start of a call to `name` in the Qwen3 (hermes) format: what the server writes
    before the model's own tokens when `tool_choice` forces that call. It ends where the
    tokenizer's pre-tokenizer splits (before the space that opens the arguments), so the
    model continues with the tokens it would have written itself."""
    return '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments":'


def forced_call(name: str, generated: str) -> dict[str, Any]:
    """The call to `name` whose arguments the model wrote after `forced_call_prefix`: parsed
    when the block is well formed, else the raw argument text (as OpenAI says of its own
    calls, arguments are not guaranteed to be valid JSON: the client validates them)."""
    _, calls, _ = message_fields(forced_call_prefix(name) + generated, parse_tools=True, offered={name})
    if calls:
        return calls[0]
    raw = generated.split("</tool_call>")[0].strip()
    raw = raw[:-1].rstrip() if raw.endswith("}") and raw.count("}") > raw.count("{") else raw
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": raw}}
