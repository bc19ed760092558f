"""What a chat request may carry (serve/requests.py), issue 34: an `image_url` part and the
legacy `functions` were accepted silently; now they are a 400 that names them, and any other
field the server does not apply is logged once, by name."""

from __future__ import annotations

import logging

import pytest

from actionopd_jax.serve import requests as R

MSG = [{"role": "user", "content": "hi"}]


def test_text_parts_pass_and_other_parts_are_refused_by_position():
    req = R.ChatRequest.from_json({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.messages[0]["content"][1]["text"] == "b"
    with pytest.raises(R.RequestError, match=r"messages\[0\].content\[1\]: only text parts .* got type 'image_url'"):
        R.ChatRequest.from_json({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]})


@pytest.mark.parametrize("field", ["functions", "function_call"])
def test_legacy_function_calling_is_refused(field):
    with pytest.raises(R.RequestError, match=f"'{field}' .* send 'tools' and 'tool_choice'") as err:
        R.ChatRequest.from_json({"model": "m", "messages": MSG, field: [] if field == "functions" else "auto"})
    assert err.value.status == 400


def test_unknown_fields_are_ignored_and_named_once_in_the_log(caplog, monkeypatch):
    monkeypatch.setattr(R, "_IGNORED_SEEN", set())
    with caplog.at_level(logging.WARNING, logger="actionopd_jax.serve.requests"):
        for _ in range(2):
            R.ChatRequest.from_json({"model": "m", "messages": MSG, "min_p": 0.1, "user": "u", "store": False})
    assert caplog.text.count("'min_p' is not applied by this server") == 1
    assert "'user'" not in caplog.text and "'store'" not in caplog.text
