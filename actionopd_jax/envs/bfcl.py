"""BFCL multi-turn as an `Environment` (categories base, miss_func, miss_param, long_context).

Protocol, following the package's own multi-turn inference loop:
- user turns are scripted by the dataset; each turn starts with its user message;
- the agent acts until it answers with a `Message` (an `Invalid` reply also ends the turn, as
  an undecodable reply does in BFCL); then the next turn begins;
- in miss_func, held-out functions join the tool list at their turn, whose user message is
  the package's "more functions" prompt;
- a reply with several tool calls (`ToolCalls`, native parallel function calling) is one
  step: its calls run in order, each result goes back with its call id, and the step's call
  strings are scored together, as the package's FC inference loop does;
- per turn at most `max_steps_per_turn` tool-call steps: the step that exceeds it ends the
  whole episode (BFCL's force-quit), and the run then fails unless it was the last turn.
A task whose payload sets `max_turns` is played and scored on its first user turns only.
Tool calls run on this episode's own instances, by method name, with keyword arguments.
Calls to tools not offered at this turn, private or blocked names, non-JSON or oversized
arguments, missing or unknown parameters become tool errors and never reach the instances or
the scorer; value types are checked only with `strict_types` (see `BFCLConfig`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from actionopd_jax.envs import bfcl_data
from actionopd_jax.chat.actions import calls_to_assistant_message
from actionopd_jax.envs.base import EnvError, assistant_message, check_step, tool_message
from actionopd_jax.envs.bfcl_exec import BFCLInstances, call_string
from actionopd_jax.envs.bfcl_fork import refusal
from actionopd_jax.envs.bfcl_score import score_bfcl
from actionopd_jax.types import Action, Observation, Reply, Task, ToolCall, ToolCalls


@dataclasses.dataclass(frozen=True)
class BFCLConfig:
    max_steps_per_turn: int = 20  # BFCL's MAXIMUM_STEP_LIMIT
    # Value types are not enforced by default: BFCL hands the model's (plain JSON) values to
    # the tool as they are, and its own data needs that (base_173 closes ticket 'ticket_001'
    # through a parameter documented as integer). True turns type/enum mismatches into tool
    # errors that never reach the tool.
    strict_types: bool = False


def _holdout_prompt() -> str:
    from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC

    return DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC


def turn_limit(task: Task) -> int:
    """The task's `payload["max_turns"]` (0: every turn), checked."""
    limit = task.payload.get("max_turns", 0) if task.payload else 0
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"task {task.task_id}: payload max_turns must be a whole number >= 0 (0: every turn), "
                         f"got {limit!r}")
    return limit


class BFCLEnv:
    name = "bfcl"
    parallel_calls = True  # step() runs a ToolCalls reply (eval/runner.py)

    def __init__(self, config: BFCLConfig | None = None, **overrides: Any):
        self.config = dataclasses.replace(config or BFCLConfig(), **overrides)
        if self.config.max_steps_per_turn < 1:
            raise ValueError("max_steps_per_turn must be >= 1")
        self._task: Task | None = None
        self._done = False

    # --- episode control ---------------------------------------------------------------------

    async def reset(self, task: Task) -> Observation:
        if task.env != self.name:
            raise ValueError(f"BFCLEnv got a task for '{task.env}'")
        self._task = task
        self._entry = bfcl_data.load_entry(task.task_id)
        # payload["max_turns"]: only the first user turns are played and scored (a shorter task)
        self._max_turns = turn_limit(task)
        self._entry["question"] = self._entry["question"][: self._max_turns or None]
        category = bfcl_data.category_of(task.task_id)
        self._instances = BFCLInstances(
            self._entry["involved_classes"], self._entry.get("initial_config", {}), long_context=category == "long_context"
        )
        self._tools = [bfcl_data.to_openai_tool(f) for f in self._entry["function"]]
        self._messages: list[dict] = []
        self._decoded: list[list[list[str]]] = []  # per finished turn: per tool step, its call strings
        self._turn_steps: list[list[str]] = []
        # what bfcl_eval's executor would have recorded: it also runs calls to a tool that is
        # only offered in a later turn (miss_func), which this environment refuses
        self._decoded_bfcl_eval: list[list[list[str]]] = []
        self._turn_steps_bfcl_eval: list[list[str]] = []
        self._turn = -1
        self._steps_in_turn = 0
        self._calls = 0
        self._done = False
        self._end_reason = ""
        self._start_turn(0)
        return self._observation()

    async def step(self, action: Action | Reply) -> tuple[Observation, bool]:
        check_step(action, started=self._task is not None, done=self._done, parallel=True)
        if isinstance(action, (ToolCall, ToolCalls)):
            self._tool_step(action.calls if isinstance(action, ToolCalls) else (action,))
        else:
            self._messages.append(assistant_message(action, call_id=""))
            self._finish_turn()
            if self._turn + 1 < len(self._entry["question"]):
                self._start_turn(self._turn + 1)
            else:
                self._done, self._end_reason = True, "completed"
        return self._observation(), self._done

    async def fork_point(self):
        """The episode's instances as a fork point for the matcher's execution stage
        (envs/bfcl_fork.py), or None when no episode is running."""
        if self._task is None or self._done:
            return None
        from actionopd_jax.envs.bfcl_fork import InstanceForkPoint, bfcl_effects

        return InstanceForkPoint(self._instances, refusal(self._tools, self._instances, self.config.strict_types),
                                 bfcl_effects(self._instances))

    def end(self, reason: str) -> Observation:
        if self._task is None:
            raise EnvError("call reset(task) before end()")
        if not self._done:
            self._done, self._end_reason = True, reason
        return self._observation()

    def score(self) -> dict[str, Any]:
        if self._task is None:
            raise EnvError("nothing to score: call reset(task) and run an episode first")
        truth = bfcl_data.ground_truth(self._task.task_id)[: self._max_turns or None]
        out = score_bfcl(self._entry, self._decoded, truth)
        if self._decoded_bfcl_eval != self._decoded:  # only then can the official executor's verdict differ
            out["bfcl_eval_official"] = score_bfcl(self._entry, self._decoded_bfcl_eval, truth)["official"]
        out["end_reason"] = self._end_reason or "running"
        out["turns_completed"] = len(self._decoded)
        return out

    def scored_calls(self) -> dict[str, list[list[list[str]]]]:
        """The call strings the checker scored, per turn and tool step ("ours"), and those
        bfcl_eval's executor would have recorded for the same replies ("bfcl_eval")."""
        return {"ours": [list(t) for t in self._decoded], "bfcl_eval": [list(t) for t in self._decoded_bfcl_eval]}

    # --- internals ---------------------------------------------------------------------------

    def _start_turn(self, index: int) -> None:
        self._turn = index
        self._steps_in_turn = 0
        self._turn_steps = []
        self._turn_steps_bfcl_eval = []
        turn_messages = [dict(m) for m in self._entry["question"][index]]
        held_out = self._entry.get("missed_function", {}).get(str(index))
        if held_out:
            self._tools = self._tools + [bfcl_data.to_openai_tool(f) for f in held_out]
            if not turn_messages:
                turn_messages = [{"role": "user", "content": _holdout_prompt()}]
        self._messages.extend(turn_messages)

    def _finish_turn(self) -> None:
        self._decoded.append(self._turn_steps)
        self._turn_steps = []
        self._decoded_bfcl_eval.append(self._turn_steps_bfcl_eval)
        self._turn_steps_bfcl_eval = []

    def _tool_step(self, calls: tuple[ToolCall, ...]) -> None:
        """One reply's tool calls (one, or several run in order): one step of the turn."""
        ids = [f"call_{self._calls + k}" for k in range(len(calls))]
        self._calls += len(calls)
        self._messages.append(calls_to_assistant_message(calls, ids))
        step, step_bfcl_eval = [], []
        for call, call_id in zip(calls, ids):
            # the rule a fork of this episode applies too (envs/bfcl_fork.py): one definition
            problem = refusal(self._tools, self._instances, self.config.strict_types)(call)
            if problem is None:
                result = self._instances.execute(call.name, call.arguments)
                step.append(call_string(call.name, call.arguments))
                step_bfcl_eval.append(call_string(call.name, call.arguments))
            else:
                result = f"Error during execution: {problem}"
                if call.name in self._offered_later() and self._instances.has_method(call.name):
                    step_bfcl_eval.append(call_string(call.name, call.arguments))
            self._messages.append(tool_message(call_id, call.name, result))
        # a step whose calls were all refused records nothing (as a refused single call did)
        if step:
            self._turn_steps.append(step)
        if step_bfcl_eval:
            self._turn_steps_bfcl_eval.append(step_bfcl_eval)
        self._steps_in_turn += 1
        if self._steps_in_turn > self.config.max_steps_per_turn:
            # BFCL force-quit: this turn is recorded, later turns never happen.
            self._finish_turn()
            self._done, self._end_reason = True, "step_limit"

    def _offered_later(self) -> set[str]:
        held_out = self._entry.get("missed_function", {})
        return {f["name"] for turn, fs in held_out.items() if int(turn) > self._turn for f in fs}

    def _observation(self) -> Observation:
        info = {"turn": self._turn, "step_in_turn": self._steps_in_turn}
        if self._done:
            info["end_reason"] = self._end_reason
        return Observation(messages=[dict(m) for m in self._messages], tools=list(self._tools), done=self._done, info=info)
