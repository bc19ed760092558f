"""Vertex AI request building (offline) and the local in-process teacher (privileged context)."""

import asyncio
import json

import pytest
from google.genai import errors as genai_errors
from google.genai import types

from actionopd_jax.teacher.cached import CachedTeacher
from actionopd_jax.teacher.local_provider import LocalTeacher, LocalTeacherConfig, with_privileged_context
from actionopd_jax.teacher.transport import RetryPolicy
from actionopd_jax.teacher.vertex_provider import VertexTeacher, VertexTeacherConfig, build_contents, candidate_message
from actionopd_jax.types import Message, ToolCall
from tests._teacher_fixtures import STATE, TOOLS

HISTORY = STATE + [
    {"role": "assistant", "content": "", "reasoning_content": "private thoughts",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]


def test_vertex_request_building_offline():
    teacher = VertexTeacher(VertexTeacherConfig(model="gemini-test", project="p", top_k=20, thinking_budget=1024),
                            client=object())
    req = teacher.build_request(HISTORY, TOOLS, 3)
    assert req["model"] == "gemini-test"
    cfg = req["config"]
    assert cfg.system_instruction == "You are a weather assistant."
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.candidate_count) == (0.6, 0.95, 20, 3)
    assert cfg.thinking_config.thinking_budget == 1024 and cfg.thinking_config.include_thoughts
    assert cfg.automatic_function_calling.disable is True
    decl = cfg.tools[0].function_declarations[0]
    assert decl.name == "get_weather" and decl.parameters_json_schema == TOOLS[0]["function"]["parameters"]
    roles = [c.role for c in req["contents"]]
    assert roles == ["user", "model", "user"]  # the tool result and the next user turn are merged
    call = req["contents"][1].parts[0].function_call
    assert call.name == "get_weather" and call.args == {"city": "Paris"}
    response = req["contents"][2].parts[0].function_response
    assert response.name == "get_weather" and response.response == {"result": '{"temp_c": 21}'}
    assert req["contents"][2].parts[1].text == "Thanks. And tomorrow?"
    # reasoning is never sent back
    assert "private thoughts" not in json.dumps([c.model_dump(mode="json") for c in req["contents"]])
    # the request is a valid google-genai request object (serialises without error)
    assert cfg.model_dump(mode="json")["candidate_count"] == 3
    with pytest.raises(ValueError, match="tool_call_id"):
        build_contents([{"role": "tool", "tool_call_id": "nope", "content": "x"}])


def _candidate(parts, finish="STOP"):
    return types.Candidate(content=types.Content(role="model", parts=parts), finish_reason=finish)


def test_vertex_candidate_parsing():
    msg, reasoning, truncated = candidate_message(_candidate([
        types.Part(text="Let me think", thought=True),
        types.Part(function_call=types.FunctionCall(name="get_weather", args={"city": "Paris"})),
        types.Part(function_call=types.FunctionCall(name="get_weather", args={"city": "Rome"})),
    ]))
    assert reasoning == "Let me think" and not truncated and msg["content"] == ""
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"city": "Paris"}, {"city": "Rome"}]
    _, _, cut = candidate_message(_candidate([types.Part(text="It is")], finish="MAX_TOKENS"))
    assert cut


class _StandInModels:
    """Stand-in for `client.aio.models` (a mock: no Vertex endpoint is reachable offline).
    It returns real google-genai response objects, and fails with real google-genai errors."""

    def __init__(self, script):
        self.script = list(script)
        self.requests = []

    async def generate_content(self, **kwargs):
        self.requests.append(kwargs)
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        n = kwargs["config"].candidate_count or 1
        return types.GenerateContentResponse(
            candidates=[_candidate(item) for _ in range(n)],
            usage_metadata=types.GenerateContentResponseUsageMetadata(prompt_token_count=50, candidates_token_count=9,
                                                                      thoughts_token_count=3,
                                                                      cached_content_token_count=40))


class _StandInClient:
    def __init__(self, models):
        self.aio = type("Aio", (), {"models": models})()


def test_vertex_teacher_retries_and_regenerates_with_stand_in_client():
    call = [types.Part(function_call=types.FunctionCall(name="get_weather", args={"city": "Paris"}))]
    unknown = [types.Part(function_call=types.FunctionCall(name="launch_rocket", args={}))]
    models = _StandInModels([genai_errors.ServerError(503, {"error": {"message": "busy"}}), unknown, call])
    teacher = VertexTeacher(VertexTeacherConfig(model="gemini-test", project="p",
                                                retry=RetryPolicy(base_delay_s=0.001, max_delay_s=0.002)),
                            client=_StandInClient(models))
    batch = asyncio.run(teacher.sample_detailed(STATE, TOOLS, 2))
    assert [s.action for s in batch.samples] == [ToolCall("get_weather", {"city": "Paris"})] * 2
    assert batch.regenerations == 2 and teacher.usage.transport_retries == 1
    assert [r["config"].candidate_count for r in models.requests] == [2, 2, 2]
    assert teacher.usage.prompt_tokens == 100 and teacher.usage.completion_tokens == 24
    assert teacher.usage.cached_prompt_tokens == 80   # Gemini's context cache: 40 of each 50-token prompt
    # a 4xx is permanent: raised, not retried
    models400 = _StandInModels([genai_errors.ClientError(400, {"error": {"message": "bad schema"}})])
    bad = VertexTeacher(VertexTeacherConfig(model="g", project="p"), client=_StandInClient(models400))
    with pytest.raises(Exception, match="400"):
        asyncio.run(bad.sample(STATE, TOOLS, 1))
    assert len(models400.requests) == 1


def test_local_teacher_privileged_context_never_reaches_the_student(tmp_path):
    seen = []

    schema_violation = '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>'

    async def generate(messages, tools, n):
        seen.append(messages)
        if len(seen) == 1:
            return ['<think>the user wants Paris</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                    "Which city?", schema_violation]
        return [schema_violation] * n

    student_view = [dict(m) for m in STATE]
    teacher = LocalTeacher(generate, LocalTeacherConfig(model="self@step-3", privileged_context="GUIDANCE: act directly."))
    batch = asyncio.run(teacher.sample_detailed(student_view, TOOLS, 3, key_info={"privileged_context": "GOAL: Paris"}))
    assert student_view == STATE  # the caller's messages are untouched
    system = seen[0][0]["content"]
    assert system.startswith("GUIDANCE: act directly.\n\nGOAL: Paris\n\n") and system.endswith(STATE[0]["content"])
    assert [s.action for s in batch.samples] == [ToolCall("get_weather", {"city": "Paris"}), Message("Which city?")]
    assert batch.samples[0].reasoning == "the user wants Paris"
    assert batch.regenerations == 2 and len(seen) == 3  # the schema-invalid third slot, asked twice more
    assert with_privileged_context([{"role": "user", "content": "hi"}], "P")[0] == {"role": "system", "content": "P"}
    # per-task privileged text is part of the cache key
    ct = CachedTeacher(teacher, None)
    assert ct.key(STATE, TOOLS, 3, {"privileged_context": "A"}) != ct.key(STATE, TOOLS, 3, {"privileged_context": "B"})


def test_factory_builds_from_plain_dicts(tmp_path):
    from actionopd_jax.matching.build import build_matcher
    from actionopd_jax.teacher.factory import build_teacher
    from actionopd_jax.teacher.openai_provider import OpenAITeacher

    t = build_teacher({"provider": "vllm", "model": "m", "base_url": "http://127.0.0.1:1/v1", "api_key_env": None,
                       "retry": {"max_attempts": 2}})
    assert isinstance(t, OpenAITeacher) and t.cfg.retry.max_attempts == 2
    cached = build_teacher({"provider": "deepseek", "model": "m", "base_url": "http://x/v1", "api_key_env": None},
                           cache=tmp_path / "c.sqlite")
    assert isinstance(cached, CachedTeacher) and cached.identity["provider"] == "deepseek"
    assert isinstance(build_teacher({"provider": "vertex", "model": "g", "project": "p"}), VertexTeacher)
    with pytest.raises(ValueError, match="unknown key.*'temprature'.*accepted"):
        build_teacher({"provider": "vllm", "model": "m", "base_url": "http://x", "temprature": 0.1})
    with pytest.raises(ValueError, match="needs a generate function"):
        build_teacher({"provider": "local"})
    m = build_matcher({"model": "j", "base_url": "http://x/v1", "api_key_env": None}, cache=tmp_path / "v.sqlite")
    assert m.judge is not None and m.cache is not None and build_matcher(None).judge is None
