"""Teacher on Vertex AI (Gemini and other models served by `generate_content`) via google-genai.

Request building is pure and tested offline: OpenAI-style messages become `contents`
(system/developer text -> `system_instruction`; assistant tool calls -> `function_call` parts;
tool results -> `function_response` parts, grouped into one user turn), tool schemas become
`function_declarations` (JSON schema passed as is), decoding settings go to
`GenerateContentConfig`. A reply is converted back to an OpenAI-style message and parsed by
the same teacher parser as every other provider (first tool call kept).

Authentication: application default credentials (service account / `gcloud auth`), or an
express-mode API key read from the environment variable named by `api_key_env`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from actionopd_jax import paid_calls
from actionopd_jax.teacher.base import MAX_REGENERATIONS, RegeneratingSampler, UsageReport, paid_replies
from actionopd_jax.teacher.endpoint import read_api_key
from actionopd_jax.teacher.openai_provider import reply_text
from actionopd_jax.teacher.transport import RetryPolicy, RetryStats, call_with_retries, classify
from actionopd_jax.types import Action, ChatMessage, Invalid, TeacherSample, ToolSchema


@dataclass(frozen=True)
class VertexTeacherConfig:
    model: str                                  # e.g. "gemini-2.5-flash"
    project: str | None = None                  # default: $GOOGLE_CLOUD_PROJECT
    location: str = "us-central1"
    api_key_env: str | None = None              # express mode; None: application default credentials
    temperature: float | None = 0.6
    top_p: float | None = 0.95
    top_k: int | None = None
    max_output_tokens: int | None = 8192
    seed: int | None = None
    thinking_budget: int | None = None          # None: model default; 0 disables thinking where allowed
    include_thoughts: bool = True               # return thought summaries as reasoning
    use_candidate_count: bool = True            # ask for several candidates in one request
    prompt_version: str = "v1"
    request_timeout_s: float = 300.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_concurrency: int = 16
    max_regenerations: int = MAX_REGENERATIONS


def _function_names_by_call_id(messages: list[ChatMessage]) -> dict[str, str]:
    names: dict[str, str] = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                names[str(call.get("id"))] = str(call["function"].get("name"))
    return names


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return ""


def build_contents(messages: list[ChatMessage]) -> tuple[str | None, list[Any]]:
    """(system_instruction, contents) for `generate_content`."""
    from google.genai import types

    system: list[str] = []
    contents: list[types.Content] = []
    call_names = _function_names_by_call_id(messages)

    def append(role: str, parts: list[types.Part]) -> None:
        if contents and contents[-1].role == role:  # consecutive turns of one role are merged
            contents[-1].parts.extend(parts)
        else:
            contents.append(types.Content(role=role, parts=parts))

    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("system", "developer"):
            system.append(_text(m.get("content")))
        elif role == "user":
            append("user", [types.Part(text=_text(m.get("content")))])
        elif role == "assistant":
            parts = [types.Part(text=_text(m.get("content")))] if _text(m.get("content")) else []
            for call in m.get("tool_calls") or []:
                fn = call["function"]
                args = fn.get("arguments")
                args = json.loads(args) if isinstance(args, str) and args.strip() else (args or {})
                parts.append(types.Part(function_call=types.FunctionCall(name=fn["name"], args=args)))
            append("model", parts or [types.Part(text="")])
        elif role == "tool":
            name = m.get("name") or call_names.get(str(m.get("tool_call_id")))
            if not name:
                raise ValueError(f"messages[{i}] (tool result) names no function and its tool_call_id matches no call")
            response = {"result": _text(m.get("content"))}
            append("user", [types.Part(function_response=types.FunctionResponse(name=name, response=response))])
        else:
            raise ValueError(f"messages[{i}] has unsupported role {role!r}")
    return ("\n\n".join(s for s in system if s) or None), contents


def build_tools(tools: list[ToolSchema]) -> list[Any]:
    from google.genai import types

    decls = []
    for t in tools:
        fn = t["function"]
        decls.append(types.FunctionDeclaration(name=fn["name"], description=fn.get("description") or "",
                                               parameters_json_schema=fn.get("parameters") or {"type": "object"}))
    return [types.Tool(function_declarations=decls)] if decls else []


def build_config(cfg: VertexTeacherConfig, tools: list[ToolSchema], system: str | None, n: int) -> Any:
    from google.genai import types

    thinking = None
    if cfg.thinking_budget is not None or cfg.include_thoughts:
        thinking = types.ThinkingConfig(thinking_budget=cfg.thinking_budget, include_thoughts=cfg.include_thoughts)
    return types.GenerateContentConfig(
        system_instruction=system,
        tools=build_tools(tools) or None,
        # The teacher only proposes actions; nothing is executed on its side.
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed,
        max_output_tokens=cfg.max_output_tokens, candidate_count=n if n > 1 else None,
        thinking_config=thinking,
    )


def candidate_message(candidate: Any) -> tuple[dict[str, Any], str, bool]:
    """(OpenAI-style assistant message, reasoning, truncated) of one response candidate."""
    texts, thoughts, calls = [], [], []
    content = getattr(candidate, "content", None)
    for part in (getattr(content, "parts", None) or []):
        if getattr(part, "function_call", None) is not None:
            fc = part.function_call
            calls.append({"id": f"call_{len(calls)}", "type": "function",
                          "function": {"name": fc.name, "arguments": json.dumps(fc.args or {}, ensure_ascii=False)}})
        elif getattr(part, "thought", False) and part.text:
            thoughts.append(part.text)
        elif part.text:
            texts.append(part.text)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    finish = str(getattr(candidate, "finish_reason", "") or "")
    return message, "\n".join(thoughts), finish.endswith("MAX_TOKENS")


def classify_vertex(err: BaseException) -> tuple[bool, float | None]:
    code = getattr(err, "code", None)
    if isinstance(code, int) and type(err).__module__.startswith("google.genai"):
        return (code in (408, 409, 429) or code >= 500), None
    return classify(err)


def _default_parser(message: dict[str, Any], tools: list[ToolSchema]) -> Action:
    from actionopd_jax.chat import action_from_openai_message

    return action_from_openai_message(message, tools, role="teacher")


class VertexTeacher(RegeneratingSampler):
    def __init__(self, cfg: VertexTeacherConfig, *, client: Any = None, rng: random.Random | None = None,
                 parse_message: Callable[[dict[str, Any], list[ToolSchema]], Action] | None = None):
        """`client`: a google.genai.Client; built lazily from the config when None."""
        self.cfg = cfg
        self._client = client
        self._rng = rng if rng is not None else random.Random()
        self._parse = parse_message or _default_parser
        self._usage = UsageReport()
        self._sem: tuple[Any, asyncio.Semaphore] | None = None

    def __repr__(self) -> str:
        return f"VertexTeacher(model={self.cfg.model!r}, location={self.cfg.location!r})"

    @property
    def identity(self) -> dict[str, Any]:
        c = self.cfg
        return {"provider": "vertex", "model": c.model, "prompt_version": c.prompt_version,
                "decoding": {"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k, "seed": c.seed,
                             "max_output_tokens": c.max_output_tokens, "thinking_budget": c.thinking_budget}}

    @property
    def usage(self) -> UsageReport:
        return self._usage

    def _get_client(self) -> Any:
        if self._client is None:
            from google import genai

            if self.cfg.api_key_env is not None:
                self._client = genai.Client(vertexai=True, api_key=read_api_key(self.cfg.api_key_env, who="vertex teacher"))
            else:
                project = self.cfg.project or os.environ.get("GOOGLE_CLOUD_PROJECT")
                if not project:
                    raise ValueError("vertex teacher: set 'project' in the config or $GOOGLE_CLOUD_PROJECT")
                self._client = genai.Client(vertexai=True, project=project, location=self.cfg.location)
        return self._client

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem[0] is not loop:
            self._sem = (loop, asyncio.Semaphore(self.cfg.max_concurrency))
        return self._sem[1]

    def build_request(self, messages: list[ChatMessage], tools: list[ToolSchema], n: int) -> dict[str, Any]:
        """Keyword arguments of `client.aio.models.generate_content` (pure)."""
        system, contents = build_contents(messages)
        return {"model": self.cfg.model, "contents": contents, "config": build_config(self.cfg, tools, system, n)}

    async def _request(self, messages: list[ChatMessage], tools: list[ToolSchema], n: int) -> list[TeacherSample]:
        request = self.build_request(messages, tools, n)
        client, sem = self._get_client(), self._semaphore()

        async def attempt() -> Any:
            async with sem:
                self._usage.http_calls += 1
                return await asyncio.wait_for(client.aio.models.generate_content(**request),
                                              timeout=self.cfg.request_timeout_s)

        stats = RetryStats()
        try:
            response = await call_with_retries(attempt, self.cfg.retry, rng=self._rng, stats=stats,
                                               classify_error=classify_vertex)
        finally:
            self._usage.transport_retries += stats.retries
        meta = getattr(response, "usage_metadata", None)
        prompt_tokens = int(getattr(meta, "prompt_token_count", 0) or 0)
        completion_tokens = (int(getattr(meta, "candidates_token_count", 0) or 0)
                             + int(getattr(meta, "thoughts_token_count", 0) or 0))  # thoughts are billed too
        self._usage.prompt_tokens += prompt_tokens
        self._usage.completion_tokens += completion_tokens
        # Gemini's implicit and explicit context caches bill cached input at a lower rate
        self._usage.cached_prompt_tokens += min(int(getattr(meta, "cached_content_token_count", 0) or 0), prompt_tokens)
        ledger = paid_calls.current()   # run.budget_* (paid_calls.py): what this request cost
        if ledger is not None:
            ledger.record("teacher", requests=stats.attempts, prompt_tokens=prompt_tokens,
                          cached_prompt_tokens=int(getattr(meta, "cached_content_token_count", 0) or 0),
                          completion_tokens=completion_tokens)
        samples = []
        for i, cand in enumerate(getattr(response, "candidates", None) or []):
            message, reasoning, truncated = candidate_message(cand)
            action = Invalid("reply truncated at max_output_tokens") if truncated else self._parse(message, tools)
            samples.append(TeacherSample(text=reply_text(message), action=action, reasoning=reasoning,
                                         prompt_tokens=prompt_tokens if i == 0 else 0,
                                         completion_tokens=completion_tokens if i == 0 else 0))
        return samples

    async def _generate(self, messages, tools, m: int) -> list[TeacherSample | BaseException]:
        return await paid_replies(lambda n: self._request(messages, tools, n), m, batched=self.cfg.use_candidate_count,
                                  messages=messages, tools=tools, max_tokens=self.cfg.max_output_tokens)
