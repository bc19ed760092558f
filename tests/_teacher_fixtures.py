"""Shared pieces for teacher / matcher / cache tests: a tool schema, a loopback server of ours
(real aiohttp HTTP on 127.0.0.1, real `openai` client on the other side), teacher configs
with test-sized timeouts."""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

from actionopd_jax.serve.faults import FaultInjector
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend
from actionopd_jax.teacher.openai_provider import OpenAITeacher, OpenAITeacherConfig
from actionopd_jax.teacher.transport import RetryPolicy

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL]
STATE = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "How warm is it in Paris?"},
]

FAST_RETRY = RetryPolicy(max_attempts=6, base_delay_s=0.01, max_delay_s=0.05, max_total_s=20.0)


@contextlib.contextmanager
def serve(backends, middleware: FaultInjector | None = None, api_key_env: str | None = None) -> Iterator[OpenAIServer]:
    server = OpenAIServer(backends, middleware=middleware, api_key_env=api_key_env)
    server.start()
    try:
        yield server
    finally:
        for hook in {middleware, server.middleware}:
            if isinstance(hook, FaultInjector):
                hook.release_hangs()
        server.stop()


def teacher_for(server: OpenAIServer, model: str = "teacher", *, provider: str = "vllm", **overrides) -> OpenAITeacher:
    cfg = dict(model=model, base_url=server.base_url, provider=provider, api_key_env=None,
               request_timeout_s=5.0, retry=FAST_RETRY, temperature=0.6, top_p=0.95)
    cfg.update(overrides)
    return OpenAITeacher(OpenAITeacherConfig(**cfg), rng=random.Random(0))


def http_attempts(server: OpenAIServer, injector: FaultInjector | None = None) -> int:
    """Requests the server received: through the fault middleware if any, else at backends."""
    return injector.requests_seen if injector is not None else server.request_count


__all__ = ["WEATHER_TOOL", "TOOLS", "STATE", "FAST_RETRY", "serve", "teacher_for", "http_attempts",
           "ScriptedBackend"]
