"""A privileged *reference teacher*: an OpenAI-compatible backend that answers with the
environment's reference policy (built from the dataset's ground truth).

It lets the whole pipeline (teacher client, cache, matcher, collector, evaluation) run for
real on a machine with no network and no large model. It is privileged — it reads the
solution — so it is labelled as such everywhere it appears and never stands in for a real
teacher's numbers.

Which task a request belongs to: the request may name it (`metadata.task_id` in the body);
otherwise it is recognised by the conversation's first user message, which is unique per task
in the supported datasets (ambiguity is reported as a 400, never guessed).

By default it is deterministic: the n choices of a request are identical. With a
`Disagreement` (envs/reference_disagreement.py) each choice is drawn on its own, seeded, so
the K teacher samples of a state can differ (the frequency bonus then has something to count).
`latency_s` holds each answer back that long (without blocking other requests), as a paid API
would, so schedules that overlap teacher calls can be measured against it.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Iterable

from actionopd_jax.envs.reference import reference_policy
from actionopd_jax.envs.reference_disagreement import Disagreement, sample_actions
from actionopd_jax.serve.requests import ChatChoice, ChatRequest, RequestError
from actionopd_jax.serve.scripted import message_choice, tool_call_choice
from actionopd_jax.types import Message, Observation, Task, ToolCall

MODEL_NAME = "reference-teacher-privileged"


def _first_user_text(messages: list[dict[str, Any]]) -> str | None:
    for m in messages:
        if m.get("role") == "user":
            content = m.get("content")
            return content if isinstance(content, str) else None
    return None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class ReferenceBackend:
    def __init__(self, tasks: Iterable[Task], *, model_name: str = MODEL_NAME,
                 disagreement: Disagreement | None = None, latency_s: float = 0.0):
        self.model_name = model_name
        self.latency_s = latency_s
        self.disagreement = disagreement if disagreement is not None and disagreement.active else None
        self._by_id: dict[str, Task] = {}
        self._by_opening: dict[str, list[Task]] = {}
        self._policies: dict[str, Any] = {}
        for task in tasks:
            self._by_id[task.task_id] = task
        self.requests = 0

    def _opening_index(self) -> dict[str, list[Task]]:
        # Built lazily on the first request that does not name its task. BFCL openings are the
        # dataset's first user message, EnvScaler's the task text; tau2 openings come from a
        # simulator, so tau2 requests must name their task.
        if not self._by_opening:
            from actionopd_jax.envs import bfcl_data

            for task in self._by_id.values():
                if task.env in ("awm", "envscaler"):
                    # the task text: the user turn (AWM, non-conversational EnvScaler), or the
                    # opening a simulator that restates the goal sends; other openings must name the task
                    text = (task.payload or {}).get("task")
                elif task.env == "bfcl":
                    text = _first_user_text(bfcl_data.load_entry(task.task_id)["question"][0])
                else:
                    continue
                if text:
                    self._by_opening.setdefault(_digest(text), []).append(task)
        return self._by_opening

    def identify(self, req: ChatRequest) -> Task:
        meta = req.raw.get("metadata") if isinstance(req.raw.get("metadata"), dict) else {}
        task_id = meta.get("task_id")
        if task_id is not None:
            task = self._by_id.get(str(task_id))
            if task is None:
                raise RequestError(400, f"unknown task_id {task_id!r} for the reference teacher")
            return task
        text = _first_user_text(req.messages)
        matches = self._opening_index().get(_digest(text)) if text else None
        if not matches:
            raise RequestError(400, "the reference teacher does not recognise this conversation "
                                    "(pass metadata.task_id, or serve the task's dataset)")
        if len(matches) > 1:
            raise RequestError(400, f"conversation opening is shared by tasks {[t.task_id for t in matches][:5]}; "
                                    "pass metadata.task_id")
        return matches[0]

    async def complete(self, req: ChatRequest) -> tuple[list[ChatChoice], int]:
        self.requests += 1
        task = self.identify(req)
        policy = self._policies.get(task.task_id)
        if policy is None:
            policy = self._policies[task.task_id] = reference_policy(task)
        try:
            if self.disagreement is None:
                actions = [policy.next_action(Observation(messages=req.messages, tools=req.tools or []))] * req.n
            else:
                actions = sample_actions(policy, req.messages, req.tools or [], req.n, self.disagreement, req.seed)
        except ValueError as e:
            raise RequestError(400, f"reference policy cannot answer this state: {e}") from e
        prompt_chars = sum(len(str(m.get("content") or "")) for m in req.messages)
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        return [_choice(a) for a in actions], max(1, prompt_chars // 4)


def _choice(action: ToolCall | Message) -> ChatChoice:
    if isinstance(action, ToolCall):
        return tool_call_choice(action.name, action.arguments)
    assert isinstance(action, Message)
    return message_choice(action.text)
