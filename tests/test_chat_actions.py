"""Parsing replies into one action (student / teacher rules), OpenAI message conversion, and
hostile output: huge, deeply nested, unterminated, invalid unicode — never a crash or a hang."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessage

from _chat_fixtures import WEATHER_TOOL
from actionopd_jax.chat import (
    action_from_openai_message,
    action_to_assistant_message,
    parse_student,
    parse_teacher,
)
from actionopd_jax.chat.actions import MAX_JSON_DEPTH, calls_to_assistant_message
from actionopd_jax.types import Invalid, Message, ToolCall, ToolCalls

MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
          "<tool_response>", "</tool_response>")
FREE_TOOL = {"type": "function", "function": {"name": "store", "description": "stores anything"}}
NOARG_TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                            "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, FREE_TOOL, NOARG_TOOL]


def call_text(name="get_weather", arguments=None, raw=None):
    body = raw if raw is not None else json.dumps({"name": name, "arguments": arguments if arguments is not None else {"city": "Paris"}})
    return f"<tool_call>\n{body}\n</tool_call>"


def reason_of(action):
    assert isinstance(action, Invalid), action
    return action.reason


# --- student ---------------------------------------------------------------------------------


def test_single_valid_call_with_reasoning_and_preamble():
    text = "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n" + call_text()
    assert parse_student(text, TOOLS) == ToolCall("get_weather", {"city": "Paris"})


def test_reasoning_opened_in_the_prompt():
    text = "The user wants weather.\n</think>\n\n" + call_text()
    assert parse_student(text, TOOLS) == ToolCall("get_weather", {"city": "Paris"})


def test_tool_call_inside_reasoning_is_not_an_action():
    text = "<think>maybe " + call_text() + "</think>\n\nIt is sunny."
    assert parse_student(text, TOOLS) == Message("It is sunny.")


def test_message_is_text_without_reasoning():
    assert parse_student("<think>\nhmm\n</think>\n\n  Basic economy cannot be changed.  \n", TOOLS) == Message(
        "Basic economy cannot be changed."
    )
    assert parse_student("Plain answer", TOOLS) == Message("Plain answer")
    # a sampler that decodes special tokens leaves the end-of-turn marker behind
    assert parse_student("Plain answer<|im_end|>", TOOLS) == Message("Plain answer")
    assert parse_student(call_text() + "<|im_end|>\n<|endoftext|>", TOOLS) == ToolCall("get_weather", {"city": "Paris"})


def test_two_calls_are_invalid_for_the_student():
    text = call_text() + "\n" + call_text(arguments={"city": "Rome"})
    assert "more than one tool call" in reason_of(parse_student(text, TOOLS))


@pytest.mark.parametrize(
    "text, expected",
    [
        (call_text(raw='{"name": "get_weather", "arguments": {"city": "Paris"'), "not valid JSON"),
        (call_text(raw="get_weather(city='Paris')"), "not valid JSON"),
        (call_text(raw='{"arguments": {"city": "Paris"}}'), "no function name"),
        (call_text(raw='{"name": "", "arguments": {}}'), "no function name"),
        (call_text(raw='{"name": 7, "arguments": {}}'), "no function name"),
        (call_text(raw='{"name": "get_weather"}'), "has no arguments object"),
        (call_text(raw='{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'), "must be a JSON object, got str"),
        (call_text(raw='{"name": "get_weather", "arguments": ["Paris"]}'), "must be a JSON object, got list"),
        (call_text(raw='["get_weather", {"city": "Paris"}]'), "must be a JSON object with name"),
        (call_text("get_forecast", {"city": "Paris"}), "unknown tool 'get_forecast'"),
        (call_text(arguments={"city": "Paris", "days": True}), "arguments.days: expected integer, got boolean True"),
        (call_text(arguments={"city": "Paris", "days": 9}), "arguments.days: must be <= 7"),
        (call_text(arguments={"city": "Paris", "unit": "kelvin"}), "is not one of"),
        (call_text(arguments={"city": "Paris", "country": "FR"}), "unexpected argument 'country'"),
        (call_text(arguments={"days": 2}), "missing required argument 'city'"),
        (call_text(raw='{"name": "get_weather", "arguments": {"city": "A", "city": "B"}}'), "duplicate key"),
        (call_text(raw='{"name": "get_weather", "arguments": {"city": "A", "days": NaN}}'), "NaN is not valid JSON"),
        (call_text(raw='{"name": "get_weather", "arguments": {"city": "A", "days": 1e999}}'), "1e999 is out of range"),
        (call_text(raw='{"name": "get_weather", "arguments": {"city": "A", "days": -2.5E+400}}'), "out of range"),
        ("", "empty reply"),
        ("  \n ", "empty reply"),
        ("<think>only reasoning</think>", "empty reply"),
        ("<think>cut off while thinking", "never closed (missing </think>)"),
        ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}", "<tool_call> is never closed"),
        ('{"name": "get_weather"}</tool_call>', "</tool_call> without a matching <tool_call>"),
        ("Sure.<|im_end|>\n<|im_start|>user\nthanks", "chat marker <|im_start|>"),
        ("Done.<|im_end|>more text", "chat marker <|im_end|>"),
        (call_text() + "\n<tool_response>\n{\"temp\": 3}\n</tool_response>", "chat marker <tool_response>"),
    ],
)
def test_student_invalid_cases(text, expected):
    assert expected in reason_of(parse_student(text, TOOLS))


def test_integral_float_is_an_integer_and_zero_arg_tool():
    assert parse_student(call_text(arguments={"city": "Paris", "days": 2.0}), TOOLS) == ToolCall(
        "get_weather", {"city": "Paris", "days": 2.0})
    assert parse_student(call_text("now", {}), TOOLS) == ToolCall("now", {})
    assert "unknown tool" in reason_of(parse_student(call_text(), []))
    assert "unknown tool" in reason_of(parse_student(call_text(), None))


def test_non_text_reply_is_invalid():
    assert "must be text" in reason_of(parse_student(b"<tool_call>", TOOLS))
    assert "must be text" in reason_of(parse_teacher(None, TOOLS))


# --- teacher -------------------------------------------------------------------------------------


def test_teacher_keeps_first_call():
    text = "<think>two calls</think>" + call_text(arguments={"city": "Paris"}) + call_text(arguments={"city": "Rome"})
    assert parse_teacher(text, TOOLS) == ToolCall("get_weather", {"city": "Paris"})
    # the rest of a multi-call reply is not inspected, even when malformed
    assert parse_teacher(call_text() + "<tool_call>{broken", TOOLS) == ToolCall("get_weather", {"city": "Paris"})


def test_teacher_invalid_first_call_is_invalid():
    text = call_text("no_such_tool", {}) + call_text()
    assert "unknown tool 'no_such_tool'" in reason_of(parse_teacher(text, TOOLS))


def test_teacher_message():
    assert parse_teacher("<think>x</think>Sure, done.", TOOLS) == Message("Sure, done.")


# --- OpenAI messages -------------------------------------------------------------------------------


def oa_call(name="get_weather", arguments='{"city": "Paris"}', call_id="c0"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize("role", ["student", "teacher"])
def test_structured_tool_call(role):
    msg = {"role": "assistant", "content": None, "tool_calls": [oa_call()]}
    assert action_from_openai_message(msg, TOOLS, role=role) == ToolCall("get_weather", {"city": "Paris"})
    msg = {"role": "assistant", "content": "", "tool_calls": [oa_call(arguments={"city": "Rome"})]}
    assert action_from_openai_message(msg, TOOLS, role=role) == ToolCall("get_weather", {"city": "Rome"})


def test_structured_multi_call_rules():
    msg = {"role": "assistant", "tool_calls": [oa_call(), oa_call(arguments='{"city": "Rome"}', call_id="c1")]}
    assert "more than one tool call" in reason_of(action_from_openai_message(msg, TOOLS, role="student"))
    assert action_from_openai_message(msg, TOOLS, role="teacher") == ToolCall("get_weather", {"city": "Paris"})
    bad_first = {"role": "assistant", "tool_calls": [oa_call(arguments="{oops"), oa_call()]}
    assert "not valid JSON" in reason_of(action_from_openai_message(bad_first, TOOLS, role="teacher"))


def test_parallel_calls_are_one_reply_in_evaluation_only():
    # evaluation (native function calling): N structured calls, or N <tool_call> blocks in the
    # content, are one ToolCalls in order; training's student rule still refuses them
    msg = {"role": "assistant", "tool_calls": [oa_call(), oa_call("now", "{}", call_id="c1")]}
    both = ToolCalls((ToolCall("get_weather", {"city": "Paris"}), ToolCall("now", {})))
    assert action_from_openai_message(msg, TOOLS, role="student", parallel=True) == both
    text = {"role": "assistant", "content": "<think>r</think>" + call_text() + "\n" + call_text("now", {})}
    assert action_from_openai_message(text, TOOLS, role="student", parallel=True) == both
    assert "more than one tool call" in reason_of(action_from_openai_message(text, TOOLS, role="student"))
    assert "more than one tool call" in reason_of(parse_student(text["content"], TOOLS))
    # one bad call makes the reply invalid, and says which
    bad = {"role": "assistant", "tool_calls": [oa_call(), oa_call("nope", "{}", call_id="c1")]}
    assert reason_of(action_from_openai_message(bad, TOOLS, role="student", parallel=True)).startswith(
        "tool call 2 of 2: unknown tool 'nope'")
    # one call stays a ToolCall
    one = {"role": "assistant", "tool_calls": [oa_call()]}
    assert action_from_openai_message(one, TOOLS, role="student", parallel=True) == ToolCall("get_weather",
                                                                                               {"city": "Paris"})


def test_calls_to_assistant_message_links_each_call_to_its_id():
    calls = [ToolCall("get_weather", {"city": "Paris"}), ToolCall("now", {})]
    msg = calls_to_assistant_message(calls, ["a", "b"])
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("a", "get_weather", {"city": "Paris"}), ("b", "now", {})]
    for ids in (["a"], ["a", "a"], ["a", ""]):
        with pytest.raises(ValueError, match="call id"):
            calls_to_assistant_message(calls, ids)


def test_structured_edge_cases():
    assert action_from_openai_message({"tool_calls": [oa_call("now", "")]}, TOOLS, role="student") == ToolCall("now", {})
    no_args = {"tool_calls": [oa_call(arguments="")]}  # "" means {}: still checked against the schema
    assert "missing required argument 'city'" in reason_of(action_from_openai_message(no_args, TOOLS, role="student"))
    assert "got list" in reason_of(action_from_openai_message({"tool_calls": [oa_call(arguments="[1]")]}, TOOLS,
                                                              role="student"))
    weird = {"tool_calls": [{"id": "c", "type": "code_interpreter", "function": {"name": "now", "arguments": "{}"}}]}
    assert "unsupported tool call type" in reason_of(action_from_openai_message(weird, TOOLS, role="student"))
    assert "no function object" in reason_of(action_from_openai_message({"tool_calls": [{"id": "x"}]}, TOOLS,
                                                                        role="student"))
    with pytest.raises(ValueError, match="role must be"):
        action_from_openai_message({"content": "x"}, TOOLS, role="judge")


def test_content_fallbacks():
    # a server without a tool parser returns the raw <tool_call> text in the content
    text_call = {"role": "assistant", "content": "<think>r</think>" + call_text()}
    assert action_from_openai_message(text_call, TOOLS, role="student") == ToolCall("get_weather", {"city": "Paris"})
    parts = {"role": "assistant", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}
    assert action_from_openai_message(parts, TOOLS, role="teacher") == Message("Hello there")
    assert "empty reply" in reason_of(action_from_openai_message({"role": "assistant", "content": None}, TOOLS,
                                                                 role="teacher"))
    assert "content must be text" in reason_of(action_from_openai_message({"content": 5}, TOOLS, role="teacher"))


def test_openai_sdk_message_object():
    msg = ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": [oa_call(arguments='{"city": "Oslo", "unit": "celsius"}')]}
    )
    assert action_from_openai_message(msg, TOOLS, role="student") == ToolCall("get_weather",
                                                                              {"city": "Oslo", "unit": "celsius"})


def test_action_to_assistant_message():
    msg = action_to_assistant_message(ToolCall("get_weather", {"city": "Zürich"}), call_id="call_7")
    assert msg == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_7", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}],
    }
    assert action_to_assistant_message(Message("Hi"), call_id="x") == {"role": "assistant", "content": "Hi"}
    with pytest.raises(ValueError, match="never committed"):
        action_to_assistant_message(Invalid("bad"), call_id="x")
    with pytest.raises(ValueError, match="call_id"):
        action_to_assistant_message(ToolCall("now", {}), call_id="")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=10), json_values, max_size=5))
def test_arguments_roundtrip_through_history_and_text(arguments):
    action = ToolCall("store", arguments)
    msg = action_to_assistant_message(action, call_id="c")
    assert action_from_openai_message(msg, TOOLS, role="student") == action
    # The text format cannot carry its own markup inside argument strings (a literal
    # "<think>" or "</tool_call>" in a value is read as markup, as in every tag-based parser);
    # the structured path above has no such limit.
    assume(not any(tag in json.dumps(arguments, ensure_ascii=False) for tag in MARKUP))
    assert parse_student(call_text("store", arguments), TOOLS) == action


def test_markup_inside_argument_strings_is_not_silently_misread():
    """The ambiguous case yields Invalid or the right action, never a different action."""
    outcomes = {}
    for value in MARKUP:
        action = parse_student(call_text("store", {"v": value}), TOOLS)
        assert isinstance(action, Invalid) or action == ToolCall("store", {"v": value}), (value, action)
        outcomes[value] = type(action).__name__
    assert outcomes["<tool_call>"] == "ToolCall"  # an opening tag inside the body is harmless
    assert outcomes["<think>"] == outcomes["</tool_call>"] == outcomes["<|im_start|>"] == "Invalid"


# --- hostile output ----------------------------------------------------------------------------------

BIG = 10 * 1024 * 1024


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def nested_body(depth: int) -> str:
    """A tool call whose whole JSON (outer object included) nests `depth` levels."""
    inner = "[" * (depth - 2) + "]" * (depth - 2)
    return '{"name": "store", "arguments": {"x": ' + inner + "}}"


def test_depth_bound_is_exact():
    assert parse_student(call_text(raw=nested_body(MAX_JSON_DEPTH)), TOOLS) == ToolCall(
        "store", json.loads(nested_body(MAX_JSON_DEPTH))["arguments"])
    assert f"nested deeper than {MAX_JSON_DEPTH}" in reason_of(
        parse_student(call_text(raw=nested_body(MAX_JSON_DEPTH + 1)), TOOLS))


HOSTILE = [
    # (name, reply text, check on the student's action, check on the teacher's action or None = same)
    ("10MB plain text", "word " * (BIG // 5), lambda a: isinstance(a, Message), None),
    ("10MB argument", call_text("store", {"blob": "x" * BIG}), lambda a: isinstance(a, ToolCall), None),
    ("100k nested brackets",
     call_text(raw='{"name": "store", "arguments": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}"),
     lambda a: "nested deeper" in a.reason, None),
    ("100k unclosed brackets", call_text(raw="[" * 100_000), lambda a: isinstance(a, Invalid), None),
    ("1M open tags", "<tool_call>" * 1_000_000, lambda a: isinstance(a, Invalid), None),
    ("400k calls", "<tool_call>{}</tool_call>" * 400_000, lambda a: "more than one" in a.reason,
     lambda a: "no function name" in a.reason),
    ("1M stray closers", "</tool_call>" * 1_000_000, lambda a: "without a matching" in a.reason, None),
    ("1M think openers", "<think>" * 1_000_000, lambda a: "never closed" in a.reason, None),
    ("1M end markers", "ok" + "<|im_end|> " * 1_000_000, lambda a: a == Message("ok"), None),
    ("500k think blocks", "<think>x</think>" * 500_000 + "done", lambda a: a == Message("done"), None),
    ("huge integer", call_text(raw='{"name": "store", "arguments": {"n": ' + "9" * 100_000 + "}}"),
     lambda a: "not valid JSON" in a.reason, None),
    ("lone surrogates in text", "caf\udce9 \ud800", lambda a: a == Message("caf\ufffd \ufffd"), None),
    ("surrogate escape in JSON", call_text(raw='{"name": "store", "arguments": {"s": "\\udc80"}}'),
     lambda a: "invalid unicode" in a.reason, None),
    ("control char in JSON string", call_text(raw='{"name": "store", "arguments": {"s": "a\x00b"}}'),
     lambda a: "not valid JSON" in a.reason, None),
]


# the timeout is the guard against a parser that backtracks without end on hostile input; no
# test asserts a duration (issue 32: wall-clock thresholds flaked on a loaded 2-core host)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, text, student_check, teacher_check", [pytest.param(*h, id=h[0]) for h in HOSTILE])
def test_hostile_replies(name, text, student_check, teacher_check):
    for parse, check in ((parse_student, student_check), (parse_teacher, teacher_check or student_check)):
        action, _ = timed(parse, text, TOOLS)
        assert check(action), (name, parse.__name__, action)


@pytest.mark.timeout(60)
def test_hostile_structured_arguments():
    deep: dict = {}
    node = deep
    for _ in range(50_000):  # deeper than Python's recursion limit: must be walked iteratively
        node["a"] = {}
        node = node["a"]
    msg = {"tool_calls": [{"id": "c", "type": "function", "function": {"name": "store", "arguments": deep}}]}
    action, _ = timed(lambda: action_from_openai_message(msg, TOOLS, role="student"))
    assert "nested deeper" in reason_of(action)
    huge = {"tool_calls": [oa_call("store", json.dumps({"k": "v" * BIG}))]}
    action, _ = timed(lambda: action_from_openai_message(huge, TOOLS, role="teacher"))
    assert isinstance(action, ToolCall)
