"""Our chat template: exact rendering, thinking on/off, tool results grouped, and the parser
recovering the action from a rendered assistant turn."""

from __future__ import annotations

import json

import numpy as np
import pytest

from _chat_fixtures import WEATHER_TOOL, qwen3_tokenizer, qwen3_tokenizer_dir, tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401
from actionopd_jax.chat import (
    action_to_assistant_message,
    parse_student,
    parse_teacher,
    render_ids,
    render_text,
)
from actionopd_jax.types import Message, ToolCall

TOOL_LINE = json.dumps(WEATHER_TOOL, ensure_ascii=False)
TOOLS_SECTION = (
    "# Tools\n\nThese functions are available to you. Each is described by a JSON schema, one per line, "
    "inside <tools></tools>:\n<tools>\n" + TOOL_LINE + "\n</tools>\n\nTo use a function, reply with one JSON "
    "object naming it and giving its arguments, wrapped in <tool_call></tool_call>:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <arguments-as-a-json-object>}\n</tool_call>\n'
    "Call at most one function per reply. To answer the user directly, reply in plain text without these tags."
)

CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I need the tool twice.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 25}'},
    {"role": "assistant", "content": "Paris 21 C, Rome 25 C.", "reasoning_content": "Both known."},
]

EXPECTED_FULL = (
    "<|im_start|>system\nYou are a weather bot.\n\n" + TOOLS_SECTION + "<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nI need the tool twice.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n"
    "<tool_response>\n{\"temp\": 25}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\nBoth known.\n</think>\n\nParis 21 C, Rome 25 C.<|im_end|>\n"
)


def test_full_conversation_renders_exactly(qwen3_tokenizer):
    text = render_text(qwen3_tokenizer, CONVERSATION, [WEATHER_TOOL], add_generation_prompt=False)
    assert text == EXPECTED_FULL


def test_generation_prompt_thinking_on_and_off(qwen3_tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    off = render_text(qwen3_tokenizer, msgs, enable_thinking=False)
    on = render_text(qwen3_tokenizer, msgs, enable_thinking=True)
    assert off == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_text(qwen3_tokenizer, msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    # the template alone (e.g. used by another server) defaults to thinking on, like Qwen3
    assert qwen3_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == on


def test_render_ids_are_the_encoded_text(qwen3_tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    ids = render_ids(qwen3_tokenizer, msgs, enable_thinking=False)
    assert ids.dtype == np.int32
    # <|im_start|> user \n hi <|im_end|> \n <|im_start|> assistant \n <think> \n\n </think> \n\n
    assert ids.tolist() == [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271]


def test_earlier_reasoning_dropped_after_new_user_turn(qwen3_tokenizer):
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "old thought"},
        {"role": "user", "content": "c"},
    ]
    text = render_text(qwen3_tokenizer, msgs, enable_thinking=True)
    assert "old thought" not in text
    assert text == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"


def test_tools_without_system_message(tiny_tokenizer):
    text = render_text(tiny_tokenizer, [{"role": "user", "content": "q"}], [WEATHER_TOOL], add_generation_prompt=False)
    assert text == "<|im_start|>system\n" + TOOLS_SECTION + "<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"


def test_content_parts_and_null_content(tiny_tokenizer):
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]},
    ]
    text = render_text(tiny_tokenizer, msgs, add_generation_prompt=False, enable_thinking=False)
    assert "<|im_start|>user\npart one, part two<|im_end|>" in text
    assert text.endswith('<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n')


@pytest.mark.parametrize("thinking", [False, True])
def test_prompt_plus_completion_equals_rendered_turn(qwen3_tokenizer, thinking):
    """The generation prompt is a prefix of the rendered conversation with the reply appended,
    so prompt ids + sampled ids line up with a re-rendered history."""
    history = CONVERSATION[:2]
    prompt = render_text(qwen3_tokenizer, history, [WEATHER_TOOL], enable_thinking=thinking)
    reply = {"role": "assistant", "content": "Checking.", "reasoning_content": "think" if thinking else ""}
    full = render_text(qwen3_tokenizer, history + [reply], [WEATHER_TOOL], add_generation_prompt=False,
                       enable_thinking=thinking)
    completion = ("<think>\nthink\n</think>\n\n" if thinking else "") + "Checking.<|im_end|>\n"
    assert full == prompt + completion


def test_parser_recovers_rendered_tool_call(qwen3_tokenizer):
    call = ToolCall("get_weather", {"city": "Paris", "days": 3, "unit": "celsius"})
    msg = action_to_assistant_message(call, call_id="call_0")
    msg["reasoning_content"] = "Use the weather tool."
    text = render_text(qwen3_tokenizer, CONVERSATION[:2] + [msg], [WEATHER_TOOL], add_generation_prompt=False)
    prompt = render_text(qwen3_tokenizer, CONVERSATION[:2], [WEATHER_TOOL], enable_thinking=True)
    assert text.startswith(prompt)
    reply = text[len(prompt):].removesuffix("<|im_end|>\n")
    assert reply.startswith("<think>\nUse the weather tool.\n</think>\n\n<tool_call>")
    assert parse_student(reply, [WEATHER_TOOL]) == call
    assert parse_teacher(reply, [WEATHER_TOOL]) == call
    # and through token ids: decode(prompt + reply ids) reproduces the text
    ids = render_ids(qwen3_tokenizer, CONVERSATION[:2] + [msg], [WEATHER_TOOL], add_generation_prompt=False)
    assert qwen3_tokenizer.decode(ids.tolist()) == text
    assert 151657 in ids.tolist() and 151658 in ids.tolist()


def test_parser_recovers_rendered_message(tiny_tokenizer):
    msg = action_to_assistant_message(Message("It is sunny."), call_id="unused")
    text = render_text(tiny_tokenizer, [{"role": "user", "content": "?"}, msg], add_generation_prompt=False)
    reply = text.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    assert parse_student(reply, [WEATHER_TOOL]) == Message("It is sunny.")


@pytest.mark.parametrize(
    "messages, tools, match",
    [
        ([{"role": "wizard", "content": "x"}], None, "role 'wizard'"),
        ("hello", None, "list of chat message dicts"),
        ([{"role": "user", "content": 5}], None, r"messages\[0\].content"),
        ([{"role": "user", "content": "x"}], {"name": "f"}, "tools must be a list"),
        ([{"role": "assistant", "tool_calls": [{"function": {}}]}], None, "function.name"),
    ],
)
def test_bad_input_is_named(tiny_tokenizer, messages, tools, match):
    with pytest.raises(ValueError, match=match):
        render_text(tiny_tokenizer, messages, tools)
