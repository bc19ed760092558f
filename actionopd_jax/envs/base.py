"""The `Environment` protocol every benchmark adapter implements, and the chat-message helpers
they share.

One environment object runs one episode at a time: `reset(task)` starts it, `step(action)`
advances it, `score()` grades it by the benchmark's own rules. `reset` and `step` are
coroutines so that a collector can keep many episodes in flight on one event loop (a user
simulator waits on HTTP; BFCL and tau2 tool calls are fast host work). The public
`Observation` holds only what the agent may see; ground truth, databases and evaluation
criteria stay inside the environment object.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from actionopd_jax.chat.actions import action_to_assistant_message
from actionopd_jax.types import Action, ChatMessage, Invalid, Message, Observation, Task, ToolCall, ToolCalls


class EnvError(RuntimeError):
    """The environment was driven out of order (step before reset, step after done)."""


@runtime_checkable
class Environment(Protocol):
    name: str

    async def reset(self, task: Task) -> Observation:
        """Start an episode of `task`; returns the first public observation. It can already
        be final (`obs.done`), e.g. when a simulated user ends the conversation at once."""
        ...

    async def step(self, action: Action) -> tuple[Observation, bool]:
        """Apply one `ToolCall`, `Message` or `Invalid`; returns the new observation and
        whether the episode has ended."""
        ...

    def end(self, reason: str) -> Observation:
        """End the episode early (e.g. the prompt no longer fits the context budget).
        No action is fabricated; `score()` grades what happened so far."""
        ...

    def score(self) -> dict[str, Any]:
        """The outcome by the benchmark's own rules. Always has `reward` (float) and
        `end_reason` (str). Synchronous and CPU-bound: run it in a thread if the loop is busy."""
        ...


def assistant_message(action: ToolCall | Message | Invalid, call_id: str) -> ChatMessage:
    """The assistant turn that `action` adds to the public conversation (the chat package's
    record of a committed action; an unparsable reply leaves an empty assistant turn, since
    its raw text is not part of any action)."""
    if isinstance(action, Invalid):
        return {"role": "assistant", "content": ""}
    return action_to_assistant_message(action, call_id=call_id)


def tool_message(call_id: str, name: str, content: str) -> ChatMessage:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def check_action(action: Any, *, parallel: bool = False) -> Action:
    if parallel and isinstance(action, ToolCalls):
        if not action.calls or not all(isinstance(c, ToolCall) for c in action.calls):
            raise TypeError("ToolCalls holds one or more ToolCall")
        return action  # type: ignore[return-value]
    if not isinstance(action, (ToolCall, Message, Invalid)):
        kinds = "a ToolCall, ToolCalls, Message or Invalid" if parallel else "a ToolCall, Message or Invalid"
        raise TypeError(f"step() takes {kinds}, got {type(action).__name__}")
    return action


def check_step(action: Any, *, started: bool, done: bool, parallel: bool = False) -> Action:
    """The preconditions of `Environment.step`, one wording for every environment: a valid
    action type, an episode begun by reset(task), and not yet over. `parallel`: the
    environment also runs a `ToolCalls` reply (`parallel_calls = True` on it: BFCL, tau2)."""
    check_action(action, parallel=parallel)
    if not started:
        raise EnvError("call reset(task) before step()")
    if done:
        raise EnvError("the episode has ended; call reset(task) for a new one")
    return action
