"""Reference policies built from each benchmark's ground truth.

Given only the public conversation so far, a reference policy returns the next reference
action, or a closing message when its reference actions for the current request are used up.
They back a privileged reference teacher in demos and tests (the privileged part is the
ground truth they read, never anything the agent's observation lacks).

- BFCL: the `possible_answer` call strings of the current turn, parsed with `ast` (literal
  arguments only, never evaluated); positional arguments are named from the method signatures.
- AWM (our mini pool only): the task's `reference_solution` (tool calls, then the final
  answer), a file of ours beside the published layout (envs/awm/layout.py SOLUTIONS_FILE).
- tau2: `evaluation_criteria.actions` in order. An action the user must do on their own
  device (telecom) becomes a message asking the user to do it; the final message carries the
  task's `communicate_info`.
- EnvScaler: the published format has no solution; our own mini data adds one
  (`reference_actions` on a scenario record, docs/formats.md). The calls in order, then a
  closing message.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from actionopd_jax.envs import bfcl_data
from actionopd_jax.envs.bfcl_exec import method_parameters, parse_call_string
from actionopd_jax.envs.tau2_tasks import tau2_task
from actionopd_jax.types import ChatMessage, Message, Observation, Task, ToolCall

BFCL_DONE = "Done: your request has been completed."
BFCL_CANNOT = "I cannot complete this request with the tools and information I have. Could you tell me what is missing?"


class ReferencePolicy(Protocol):
    def next_action(self, observation: Observation) -> ToolCall | Message: ...

    def options(self, observation: Observation) -> tuple[ToolCall | Message, list, list]:
        """(due action, other correct-looking actions, plausible wrong actions) for a
        self-disagreeing teacher (envs/reference_disagreement.py)."""
        ...


def reference_policy(task: Task) -> ReferencePolicy:
    if task.env == "bfcl":
        return BFCLReference(task)
    if task.env.startswith("tau2_"):
        return Tau2Reference(task)
    if task.env == "envscaler":
        return EnvScalerReference(task)
    if task.env == "awm":
        return AwmReference(task)
    raise ValueError(f"no reference policy for environment '{task.env}'")


def _calls_since_last_user(messages: list[ChatMessage]) -> tuple[int, list[dict]]:
    """(number of user messages, assistant tool calls after the last user message)."""
    users, calls = 0, []
    for m in messages:
        if m.get("role") == "user":
            users, calls = users + 1, []
        elif m.get("role") == "assistant":
            calls.extend(m.get("tool_calls") or [])
    return users, calls


class BFCLReference:
    def __init__(self, task: Task):
        entry = bfcl_data.load_entry(task.task_id)
        names = method_parameters(entry["involved_classes"])
        self.turns: list[list[ToolCall]] = [
            [ToolCall(*parse_call_string(s, names)) for s in turn] for turn in bfcl_data.ground_truth(task.task_id)
        ]

    def next_action(self, observation: Observation) -> ToolCall | Message:
        # Every BFCL turn opens with exactly one user message (held-out turns with the
        # package's "more functions" prompt), so user messages count turns.
        users, calls = _calls_since_last_user(observation.messages)
        turn = users - 1
        if not 0 <= turn < len(self.turns):
            raise ValueError(f"observation is at turn {turn}; the task has {len(self.turns)} turns")
        reference = self.turns[turn]
        if len(calls) < len(reference):
            return reference[len(calls)]
        return Message(BFCL_DONE if reference else BFCL_CANNOT)

    def options(self, observation: Observation) -> tuple[ToolCall | Message, list, list]:
        # Progress is the turn's reference calls already made (name and arguments), so a
        # reordered call does not derail the teacher; the call budget ends the turn as in
        # next_action.
        users, calls = _calls_since_last_user(observation.messages)
        turn = users - 1
        if not 0 <= turn < len(self.turns):
            raise ValueError(f"observation is at turn {turn}; the task has {len(self.turns)} turns")
        reference = self.turns[turn]
        remaining = list(reference)
        for call in calls:
            made = _tool_call_of(call)
            if made in remaining:
                remaining.remove(made)
        if remaining and len(calls) < len(reference):
            due = remaining[0]
            others: list[ToolCall] = []
            for c in remaining[1:]:
                if c != due and c not in others:
                    others.append(c)
            return due, others, [Message(BFCL_DONE)]
        if reference:
            return Message(BFCL_DONE), [], [reference[-1]]
        return Message(BFCL_CANNOT), [], [Message(BFCL_DONE)]


def _tool_call_of(call: dict) -> ToolCall | None:
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except (TypeError, json.JSONDecodeError):
        return None
    return ToolCall(fn.get("name", ""), args) if isinstance(args, dict) else None


def user_action_request(name: str, arguments: dict[str, Any]) -> str:
    """The message that asks the user to perform one of their own device actions."""
    args = f" with {json.dumps(arguments, sort_keys=True)}" if arguments else ""
    return f"Please do this on your device: {name}{args}. Tell me when it is done."


class Tau2Reference:
    def __init__(self, task: Task):
        domain, tau2_id = task.payload.get("domain"), task.payload.get("tau2_id")
        if domain is None or tau2_id is None:
            domain, tau2_id = task.task_id.split("/", 1)
        criteria = tau2_task(domain, tau2_id).evaluation_criteria
        self.actions = list(criteria.actions or []) if criteria else []
        self.communicate = list(criteria.communicate_info or []) if criteria else []

    def _progress(self, messages: list[ChatMessage]) -> int:
        """How many reference actions the public history has already carried out, in order."""
        done = 0
        for m in messages:
            if m.get("role") != "assistant" or done >= len(self.actions):
                continue
            action = self.actions[done]
            if action.requestor == "user":
                if m.get("content") == user_action_request(action.name, action.arguments):
                    done += 1
                continue
            # one message may carry several calls (native parallel calls): each that is the
            # next reference action, in order, counts
            for call in m.get("tool_calls") or []:
                if done >= len(self.actions) or self.actions[done].requestor == "user":
                    break
                action = self.actions[done]
                fn = call["function"]
                try:
                    args = json.loads(fn["arguments"])
                except (TypeError, json.JSONDecodeError):
                    continue
                if fn["name"] == action.name and args == action.arguments:
                    done += 1
        return done

    def next_action(self, observation: Observation) -> ToolCall | Message:
        done = self._progress(observation.messages)
        if done < len(self.actions):
            action = self.actions[done]
            if action.requestor == "user":
                return Message(user_action_request(action.name, action.arguments))
            return ToolCall(action.name, json.loads(json.dumps(action.arguments)))
        closing = "Everything you asked for is taken care of."
        if self.communicate:
            closing += " " + " ".join(f"{info}." for info in self.communicate)
        return Message(closing + " Is there anything else I can help with?")

    def options(self, observation: Observation) -> tuple[ToolCall | Message, list, list]:
        due = self.next_action(observation)
        done = self._progress(observation.messages)
        if done < len(self.actions):  # a premature closing message is the plausible wrong one
            return due, [], [Message("Everything you asked for is taken care of. Is there anything else I can help with?")]
        return due, [], []

ENVSCALER_DONE = "Task Completed: everything you asked for is done."


class EnvScalerReference:
    """The scenario's `reference_actions` (our mini data's extension), in order: the next one
    the public history has not carried out yet, then a closing message."""

    def __init__(self, task: Task):
        actions = (task.payload or {}).get("reference_actions")
        if not actions:
            raise ValueError(f"EnvScaler task {task.task_id} has no reference_actions (the published format has "
                             "no solution; only our own mini data adds one)")
        self.actions = [ToolCall(a["name"], dict(a.get("arguments") or {})) for a in actions]

    def next_action(self, observation: Observation) -> ToolCall | Message:
        done = 0
        for m in observation.messages:
            if m.get("role") != "assistant" or done >= len(self.actions):
                continue
            for call in m.get("tool_calls") or []:
                fn = call["function"]
                try:
                    args = json.loads(fn["arguments"])
                except (TypeError, json.JSONDecodeError):
                    continue
                if fn["name"] == self.actions[done].name and args == self.actions[done].arguments:
                    done += 1
                    break
        if done < len(self.actions):
            return ToolCall(self.actions[done].name, json.loads(json.dumps(self.actions[done].arguments)))
        return Message(ENVSCALER_DONE)


class AwmReference:
    """The task's reference solution in order: the k-th tool call of the episode (one user
    turn), then its final answer."""

    def __init__(self, task: Task):
        steps = (task.payload or {}).get("reference_solution")
        if not steps:
            raise ValueError(f"AWM task {task.task_id} has no reference solution (published AWM pools have none; "
                             "our mini pool carries one in reference_solutions.jsonl)")
        self.calls = [ToolCall(s["tool"], dict(s.get("arguments") or {})) for s in steps if "tool" in s]
        self.answer = next((s["message"] for s in steps if "message" in s), "Done.")

    def next_action(self, observation: Observation) -> ToolCall | Message:
        _, calls = _calls_since_last_user(observation.messages)
        if len(calls) < len(self.calls):
            call = self.calls[len(calls)]
            return ToolCall(call.name, json.loads(json.dumps(call.arguments)))
        return Message(self.answer)

    def options(self, observation: Observation) -> tuple[ToolCall | Message, list, list]:
        due = self.next_action(observation)
        # a premature final answer is the plausible wrong one while calls are due
        return due, [], ([Message(self.answer)] if isinstance(due, ToolCall) else [])
