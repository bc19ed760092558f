"""Chat format: tokenizers, the chat template, and parsing replies into actions.

Names are imported lazily (PEP 562) so that `from actionopd_jax.chat import parse_student`
does not pull in transformers / tokenizers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "action_from_openai_message": "actionopd_jax.chat.actions",
    "action_to_assistant_message": "actionopd_jax.chat.actions",
    "parse_student": "actionopd_jax.chat.actions",
    "parse_teacher": "actionopd_jax.chat.actions",
    "validate_arguments": "actionopd_jax.chat.schema",
    "chat_template_source": "actionopd_jax.chat.template",
    "render_ids": "actionopd_jax.chat.template",
    "render_text": "actionopd_jax.chat.template",
    "build_tiny_tokenizer": "actionopd_jax.chat.tiny_tokenizer",
    "build_qwen3_tokenizer": "actionopd_jax.chat.tokenizer",
    "load_tokenizer": "actionopd_jax.chat.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actionopd_jax.chat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
