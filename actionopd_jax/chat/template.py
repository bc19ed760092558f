"""Rendering a conversation (+ tool schemas) to prompt text / token ids via the chat template.

Our template (chat_template.jinja, shipped as package data) uses the Qwen3 token layout with
our own instruction wording; any tokenizer that carries its own template (a real Qwen3
checkpoint, say) is rendered with that template instead, as the paper uses native templates.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any, Sequence

import numpy as np

from actionopd_jax.types import ChatMessage, ToolSchema

_ROLES = ("system", "user", "assistant", "tool")


@functools.lru_cache(maxsize=1)
def chat_template_source() -> str:
    """Text of our jinja chat template (package data file chat_template.jinja)."""
    return resources.files("actionopd_jax.chat").joinpath("chat_template.jinja").read_text(encoding="utf-8")


def check_messages(messages: Sequence[ChatMessage], tools: Sequence[ToolSchema] | None) -> None:
    """Raise ValueError naming the first malformed message or tool (templates fail obscurely)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of chat message dicts, got {type(messages).__name__}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}] has role {role!r}; expected one of {_ROLES}")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list, dict)):
            raise ValueError(f"messages[{i}].content must be a string, a list of parts or null, got {type(content).__name__}")
        calls = msg.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls must be a list on an assistant message")
            for j, call in enumerate(calls):
                fn = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"messages[{i}].tool_calls[{j}] needs function.name (a string)")
    if tools is not None:
        if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence):
            raise ValueError(f"tools must be a list of tool schema dicts, got {type(tools).__name__}")
        for k, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise ValueError(f"tools[{k}] must be a dict (OpenAI function tool), got {type(tool).__name__}")


def render_text(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSchema] | None = None,
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
) -> str:
    """The prompt text for `messages` (+ `tools`) under the tokenizer's chat template
    (ours if it has none). `enable_thinking=False` pre-fills an empty reasoning block."""
    check_messages(messages, tools)
    template = getattr(tokenizer, "chat_template", None) or chat_template_source()
    return tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
        tokenize=False,
    )


def render_ids(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSchema] | None = None,
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
) -> np.ndarray:
    """Token ids (int32) of render_text(...); special-token strings map to their ids."""
    text = render_text(
        tokenizer, messages, tools, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    return np.asarray(ids, dtype=np.int32)
