"""EndpointAgent over a real HTTP server (a scripted OpenAI-compatible stub on 127.0.0.1, the
real `openai` client): issue 34's warm-start faults. A reply with no choices or an unparsable
tool call is asked again (with another seed) when the agent is a teacher (retries,
retry_invalid), never silently for a student under evaluation, and what is still empty after
the retries is AgentUnavailable, not an IndexError."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from actionopd_jax.eval.agents import AgentUnavailable, EndpointAgent
from actionopd_jax.types import Invalid, Observation, Task, ToolCall

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def _completion(message: dict | None) -> dict:
    choices = [] if message is None else [{"index": 0, "message": message, "finish_reason": "stop"}]
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": choices}


EMPTY = _completion(None)
BAD = _completion({"role": "assistant", "content": None, "tool_calls": [
    {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]})
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
                data = json.dumps(stub.script.pop(0) if stub.script else GOOD).encode()
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


def _act(agent):
    obs = Observation(messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS)
    return asyncio.run(agent.act(obs, task=Task(task_id="t", env="toy"), trial=3))


def test_a_teacher_asks_again_after_empty_and_unparsable_replies():
    stub = _Stub([EMPTY, BAD, GOOD])
    try:
        action = _act(EndpointAgent(stub.url, "m", retries=2, retry_invalid=True))
    finally:
        stub.close()
    assert isinstance(action, ToolCall) and action.arguments == {"city": "Paris"}
    assert len(stub.seeds) == 3 and len(set(stub.seeds)) == 3 and stub.seeds[0] == 3


def test_a_student_keeps_its_invalid_reply_and_an_empty_one_is_unavailable():
    stub = _Stub([BAD, EMPTY, EMPTY])
    try:
        assert isinstance(_act(EndpointAgent(stub.url, "m")), Invalid)          # its answer, scored as such
        with pytest.raises(AgentUnavailable, match="no choices .2 request"):
            _act(EndpointAgent(stub.url, "m", retries=1))
    finally:
        stub.close()
