"""Reply text -> OpenAI message fields (content, tool_calls, reasoning_content)."""

import json

from actionopd_jax.serve.reply_format import message_fields


def test_tool_call_blocks_become_tool_calls():
    text = ('<think>\nneed the weather\n</think>\n\nLet me check.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call><|im_end|>')
    content, calls, reasoning = message_fields(text, parse_tools=True)
    assert content == "Let me check." and reasoning == "need the weather"
    (call,) = calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_two_calls_are_both_returned():
    block = '<tool_call>\n{{"name": "{}", "arguments": {{}}}}\n</tool_call>'
    _, calls, _ = message_fields(block.format("a") + "\n" + block.format("b"), parse_tools=True)
    assert [c["function"]["name"] for c in calls] == ["a", "b"]


def test_malformed_blocks_stay_in_content():
    for body in ('{"name": "f", "arguments": {"x": 1}', '{"arguments": {}}', '{"name": "f", "arguments": "x=1"}',
                 '{"name": "f", "arguments": {}, "name": "g"}',
                 # 1e999 would decode to inf and be written back as the non-JSON token Infinity
                 '{"name": "f", "arguments": {"x": 1e999}}'):
        text = f"<tool_call>\n{body}\n</tool_call>"
        content, calls, _ = message_fields(text, parse_tools=True)
        assert calls is None and content == text, body
    content, calls, _ = message_fields("<tool_call>\n{\"name\": \"f\"", parse_tools=True)
    assert calls is None and content.startswith("<tool_call>")


def test_plain_text_no_tools_and_cut_off_reasoning():
    assert message_fields("Hello there.<|im_end|>", parse_tools=True) == ("Hello there.", None, None)
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert message_fields(text, parse_tools=False) == (text, None, None)
    content, calls, reasoning = message_fields("<think>\nstill thinking", parse_tools=True)
    assert content == "<think>\nstill thinking" and calls is None and reasoning is None
    assert message_fields("</think>\n\nDone.", parse_tools=True) == ("Done.", None, None)


def test_forced_call_takes_the_model_arguments_parsed_or_raw():
    from actionopd_jax.serve.reply_format import forced_call, forced_call_prefix

    assert forced_call_prefix("f") == '<tool_call>\n{"name": "f", "arguments":'
    call = forced_call("f", ' {"a": 1}}\n</tool_call>')
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'} and call["type"] == "function"
    # cut off, or not JSON: the raw argument text, still a call to f (the client validates it)
    assert forced_call("f", ' {"a": 1')["function"] == {"name": "f", "arguments": '{"a": 1'}
    assert forced_call("f", " oops}\n</tool_call>")["function"] == {"name": "f", "arguments": "oops"}


def test_a_block_naming_a_tool_not_offered_stays_content():
    text = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    assert message_fields(text, parse_tools=True, offered={"f"}) == (text, None, None)
    assert message_fields(text, parse_tools=True, offered={"g"})[1][0]["function"]["name"] == "g"
