"""EndpointAgent over a real HTTP server (a scripted OpenAI-compatible stub on 127.0.0.1, the
real `openai` client): issue 34's and issue 46's warm-start faults. A body that is no usable
completion (no choices, not JSON) is retried by the collector's teacher client's transport rule
and counted; an unparsable tool call is asked again (with another seed) when the agent is a
teacher (retries, retry_invalid), never silently for a student under evaluation; what is still
unusable after the retries is AgentUnavailable naming the endpoint, not an IndexError or a
JSONDecodeError."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from actionopd_jax.eval.agents import AgentUnavailable, EndpointAgent
from actionopd_jax.teacher.transport import RetryPolicy
from actionopd_jax.types import Invalid, Observation, Task, ToolCall

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def _completion(message: dict | None) -> dict:
    choices = [] if message is None else [{"index": 0, "message": message, "finish_reason": "stop"}]
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": choices}


EMPTY = _completion(None)
BAD = _completion({"role": "assistant", "content": None, "tool_calls": [
    {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]})
NOT_JSON = b'{"id": "c", "choices": [{"index": 0, "message": {"role": "assis'   # a body cut mid-way
GOOD = _completion({"role": "assistant", "content": None, "tool_calls": [
    {"id": "2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]})


class _Stub:
    def __init__(self, script):
        self.script, self.seeds = list(script), []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.seeds.append(body.get("seed"))
                reply = stub.script.pop(0) if stub.script else GOOD
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


FAST = RetryPolicy(max_attempts=3, base_delay_s=0.0)   # the collector's rule, without the waits


def _act(agent):
    obs = Observation(messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS)
    return asyncio.run(agent.act(obs, task=Task(task_id="t", env="toy"), trial=3))


def test_a_teacher_asks_again_after_empty_and_unparsable_replies():
    stub = _Stub([EMPTY, BAD, GOOD])
    try:
        agent = EndpointAgent(stub.url, "m", retries=2, retry_invalid=True, retry=FAST)
        action = _act(agent)
    finally:
        stub.close()
    assert isinstance(action, ToolCall) and action.arguments == {"city": "Paris"}
    # the empty body is a transport retry (same request, same seed); the unparsable call is asked
    # again with another seed
    assert len(stub.seeds) == 3 and stub.seeds[:2] == [3, 3] and stub.seeds[2] != 3
    assert agent.usage.malformed_replies == 1 and agent.usage.transport_retries == 1


def test_a_malformed_200_body_is_retried_and_counted():
    """Issue 46 item 4: a 200 whose body is not JSON ended the warm-start episode (the decode
    error escaped `_ask`); it is retried as the collector's teacher client retries it."""
    stub = _Stub([NOT_JSON, NOT_JSON, GOOD])
    try:
        agent = EndpointAgent(stub.url, "m", retry=FAST)
        action = _act(agent)
    finally:
        stub.close()
    assert isinstance(action, ToolCall) and action.arguments == {"city": "Paris"}
    assert len(stub.seeds) == 3 and agent.usage.malformed_replies == 2 and agent.usage.http_calls == 3


def test_a_student_keeps_its_invalid_reply_and_an_empty_one_is_unavailable():
    stub = _Stub([BAD, EMPTY, EMPTY, EMPTY])
    try:
        assert isinstance(_act(EndpointAgent(stub.url, "m", retry=FAST)), Invalid)   # its answer, scored as such
        with pytest.raises(AgentUnavailable, match="no 'choices' list") as err:
            _act(EndpointAgent(stub.url, "m", retries=1, retry=FAST))
    finally:
        stub.close()
    assert stub.url in str(err.value) and "model m" in str(err.value) and "3 attempt" in str(err.value)


def test_an_outage_names_the_endpoint_the_model_and_the_error_class():
    """Issue 46 item 5: a closed port said only 'Connection error.'"""
    import socket

    with socket.socket() as s:   # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        with pytest.raises(AgentUnavailable) as err:
            _act(EndpointAgent(url, "teacher-x", retry=FAST, role="teacher"))
    text = str(err.value)
    assert url in text and "teacher-x" in text and "APIConnectionError" in text and "3 attempt" in text
    assert err.value.where == f"teacher endpoint {url} (model teacher-x)"
