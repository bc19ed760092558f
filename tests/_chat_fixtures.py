"""Chat/tokenizer fixtures shared by test files (import the fixtures you use).

The tokenizers are built once per test session into a temp dir: a module-level memo makes
repeated fixture instantiations (one per importing module) reuse the first build.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_BUILT: dict[str, Path] = {}


def _memo(kind: str, factory, build) -> Path:
    if kind not in _BUILT:
        _BUILT[kind] = build(factory.mktemp(f"{kind}_tokenizer"))
    return _BUILT[kind]


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory) -> Path:
    from actionopd_jax.chat import build_qwen3_tokenizer

    return _memo("qwen3", tmp_path_factory, build_qwen3_tokenizer)


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir):
    from actionopd_jax.chat import load_tokenizer

    return load_tokenizer(qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    from actionopd_jax.chat import build_tiny_tokenizer

    return _memo("tiny", tmp_path_factory, build_tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from actionopd_jax.chat import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
