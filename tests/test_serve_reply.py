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
    # OpenAI's layout for parallel calls (issue 43 item 3): one message, each call its own id
    # (a client links each tool result to its call by it), type function, arguments a JSON string
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    assert all(c["type"] == "function" and json.loads(c["function"]["arguments"]) == {} for c in calls)


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


# --- streaming: what may be sent before a reply is finished (serve/stream_text.py) ------------
PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>", " ", "\n", "hi", "x",
          '{"name": "f", "arguments": {}}', "<", "|", "STOP", "\ufffd"]


def _documented_difference(text: str, opened: bool) -> bool:
    """The two cases the stream_text docstring names: cut off inside reasoning, and a
    </think> after visible text."""
    from actionopd_jax.chat.reply import split_reasoning

    if split_reasoning(text)[2] or (opened and "</think>" not in text):
        return True
    close, open_ = text.find("</think>"), text.find("<think>")
    if opened:
        return 0 <= open_ < close
    return close >= 0 and (open_ < 0 or close < open_) and not text.lstrip().startswith("<think>")


def test_streamed_deltas_always_begin_the_finished_fields():
    """Random replies fed a character at a time: what the stream sent of reasoning and content
    is always the start of the finished reply's field (so the rest can follow it)."""
    import random

    from actionopd_jax.serve.stream_text import ReplyStream

    rng = random.Random(0)
    checked = streamed = 0
    for _ in range(4000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        opened, parse, stops = rng.random() < 0.3, rng.random() < 0.5, ["STOP"] if rng.random() < 0.3 else None
        full = text[:text.find("STOP")] if stops and "STOP" in text else text
        if _documented_difference(full, opened):
            continue
        content, _, reasoning = message_fields(full, parse_tools=parse, offered={"f"})
        stream = ReplyStream(stops=stops, parse_tools=parse, opened=opened)
        for k in range(len(text) + 1):
            stream.feed(text[:k])
            if stream.stop_hit:
                break
        assert (reasoning or "").startswith(stream.sent["reasoning_content"]), (text, opened, stream.sent)
        assert (content or "").startswith(stream.sent["content"]), (text, opened, parse, stream.sent)
        checked += 1
        streamed += bool(stream.sent["content"] or stream.sent["reasoning_content"])
    assert checked > 1500 and streamed > checked // 3  # most replies streamed something before the end


def test_stream_holds_back_what_may_still_change():
    from actionopd_jax.serve.stream_text import ReplyStream

    s = ReplyStream(stops=None, parse_tools=True)
    head = "<think> plan A</think>\nHello world"
    assert s.feed("<thi") == [] and s.feed("<think> plan ") == [("reasoning_content", "plan")]
    assert s.feed("<think> plan A</th") == [("reasoning_content", " A")]
    assert s.feed(head + "<|im_end|>") == [("content", "Hello world")]      # end markers may end the reply
    assert s.feed(head + "<|im_end|> again, caf\ufffd") == [("content", "<|im_end|> again, caf")]  # a partial character
    assert s.feed(head + "<|im_end|> again, caf\u00e9 <tool_call>{") == [("content", "\u00e9")]
    assert s.feed(head + "<|im_end|> again, caf\u00e9 <tool_call>{} more") == []  # after a call: at the end
    t = ReplyStream(stops=["END"], parse_tools=False)
    assert t.feed("Hello wor") == [("content", "Hello w")]                    # "or" may start END
    assert t.feed("Hello world E") == [("content", "orld")] and not t.stop_hit
    assert t.feed("Hello world END and more") == [] and t.stop_hit
