"""The data types that flow through ActionOPD, defined once and imported everywhere else.

Conventions shared by every module:
- A chat message is an OpenAI-style dict: {"role": "system"|"user"|"assistant"|"tool",
  "content": str, optional "tool_calls": [{"id", "type": "function", "function":
  {"name", "arguments": <JSON string>}}], optional "reasoning_content": str (assistant
  reasoning, never part of the action), optional "tool_call_id" / "name" on tool messages}.
- A tool schema is an OpenAI function tool: {"type": "function", "function": {"name",
  "description", "parameters": <JSON schema>}}.
- Token ids are numpy int32 arrays on the host; nothing here holds a jax.Array.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Union

import numpy as np

ChatMessage = dict[str, Any]
ToolSchema = dict[str, Any]


# --- actions: what one model reply decides -------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """Call tool `name` with JSON-decoded `arguments`."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Message:
    """Say `text` to the user (no tool call)."""

    text: str


@dataclass(frozen=True)
class Invalid:
    """A reply that is not one well-formed action; `reason` says why (for logs and metrics)."""

    reason: str


Action = Union[ToolCall, Message, Invalid]


@dataclass(frozen=True)
class ToolCalls:
    """Several tool calls in one reply (native parallel function calling), run in order, each
    result returned with its call id, as BFCL's and tau2's own runners do. Evaluation only:
    training keeps one action per decision (paper section 2), so no training path makes one
    and it is not an `Action`."""

    calls: tuple[ToolCall, ...]


# what an evaluated agent's reply can decide (eval/agents.py, eval/runner.py)
Reply = Union[ToolCall, ToolCalls, Message, Invalid]

# Matcher verdict for one (student candidate, teacher sample) pair.
Verdict = Literal["match", "no_match", "unavailable"]


# --- tasks and environment states ----------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """One task start. `env` names the environment ("bfcl", "tau2_airline", ...);
    `payload` holds the environment's own record (hidden parts stay inside the env)."""

    task_id: str
    env: str
    split: str = "train"
    payload: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass
class Observation:
    """The public state the agent sees: the conversation so far and the tools it may call."""

    messages: list[ChatMessage]
    tools: list[ToolSchema]
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


# --- one decision point of a trajectory (a state group) ------------------------------------


@dataclass
class TeacherSample:
    """One teacher reply at a state, already parsed. Only valid samples reach the matcher."""

    text: str
    action: Action
    reasoning: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    from_cache: bool = False


@dataclass
class Candidate:
    """One student sample at a state: generated ids, their sampler logprobs (full softmax at
    the rollout temperature), the decoded text and parsed action, and its reward."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    text: str
    action: Action
    finish_reason: str = "stop"
    reward: float = 0.0
    verdicts: list[Verdict] = field(default_factory=list)
    # token-level OPD baseline only: the teacher's log-probability of each sampled token
    teacher_logprobs: np.ndarray | None = None


@dataclass
class StateGroup:
    """The N candidates sampled at one state, with everything the update needs.

    `retained` is False when the group carries no learning signal (no supervision, a judge
    failure, or a reward range <= 1e-8); `drop_reason` then says which.
    """

    task_id: str
    decision_index: int
    prompt_ids: np.ndarray
    candidates: list[Candidate]
    teacher_samples: list[TeacherSample]
    committed_index: int
    retained: bool = True
    drop_reason: str = ""
    advantages: np.ndarray | None = None
    # the trainer step whose weights sampled the candidates (asynchronous collection, issue 44);
    # -1: not recorded (the synchronous collector: always the step that trains on it)
    policy_version: int = -1

    @property
    def rewards(self) -> np.ndarray:
        return np.asarray([c.reward for c in self.candidates], dtype=np.float32)
