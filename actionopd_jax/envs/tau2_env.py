"""tau2 airline / retail / telecom as an `Environment`.

The episode follows the package's orchestrator: the agent greets, the simulated user answers
(on telecom it may first act on its own device with user tools, unseen by the agent), then the
agent either calls tools or messages the user. A reply with several tool calls (`ToolCalls`,
native parallel function calling) is one agent message whose calls run in order, each result
returned with its call id, and counts as the package's orchestrator counts it (one message to
the environment, one back; an error per failed call). The episode ends when the user sends a
stop / transfer / out-of-scope signal, at the package's step and error budgets (200 messages,
10 tool errors), at an optional agent-decision budget (training uses 20), or on a protocol
failure (an unparsable agent reply, an unavailable simulator).

Transfer to a human: `transfer_to_human_agents` is an ordinary tool, as in tau2; the user
simulator then answers the agent's next message with ###TRANSFER###. With
`end_on_transfer=True` the episode ends as soon as that tool succeeds instead.

The hidden trajectory is kept in the package's own message types, so `score()` runs the
package's evaluators on it: DB state (+ env assertions), expected actions and communicate
checks as each task's reward basis says; natural-language assertions are off (as in the
paper), so an NL_ASSERTION basis contributes nothing.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from typing import Any

from actionopd_jax.chat.actions import calls_to_assistant_message
from actionopd_jax.envs.base import EnvError, assistant_message, check_step, tool_message
from actionopd_jax.envs.protocol import TRANSFER_TOOL
from actionopd_jax.envs.tau2_prompts import check_prompts, tau2_agent_system_prompt, tau2_user_system_prompt
from actionopd_jax.envs.tau2_score import score_tau2
from actionopd_jax.envs.tau2_tasks import DOMAINS, environment_constructor, env_name, tau2_task
from actionopd_jax.envs.tool_args import check_tool_call
from actionopd_jax.envs.user_sim import UserSimulator, build_user_system_prompt, has_signal
from actionopd_jax.types import Action, Invalid, Observation, Reply, Task, ToolCall, ToolCalls

GREETING = "Hi! How can I help you today?"

AGENT_INSTRUCTIONS = (
    "You are a customer-service agent. Help the user while following the policy below exactly.\n"
    "Each reply does exactly one thing: either send a message to the user, or make one tool call."
)


def agent_system_prompt(policy: str) -> str:
    return f"{AGENT_INSTRUCTIONS}\n\n<policy>\n{policy}\n</policy>"


@dataclasses.dataclass(frozen=True)
class Tau2Config:
    max_steps: int = 200  # messages, counted as the package's orchestrator counts them
    max_errors: int = 10  # tool calls that returned an error
    max_decisions: int | None = None  # agent replies per episode; None = unlimited
    max_user_tool_rounds: int = 10  # user tool calls in a row before the simulator is cut off
    end_on_transfer: bool = False
    user_seed: int | None = None  # passed to the simulator API when set
    # the agent's system prompt and the user simulator's: "actionopd" (ours: training) or
    # "tau2" (tau2's own harness prompts, read from the package: evaluation's default,
    # eval.tau2_prompts); envs/tau2_prompts.py
    prompts: str = "actionopd"


class Tau2Env:
    parallel_calls = True  # step() runs a ToolCalls reply (eval/runner.py)

    def __init__(self, domain: str, user_sim: UserSimulator | None = None, config: Tau2Config | None = None, **overrides: Any):
        if domain not in DOMAINS:
            raise ValueError(f"unknown tau2 domain '{domain}'; choose from {', '.join(DOMAINS)}")
        self.domain = domain
        self.name = env_name(domain)
        self.user_sim = user_sim
        self.config = dataclasses.replace(config or Tau2Config(), **overrides)
        check_prompts(self.config.prompts)
        self._task: Task | None = None
        self._done = False

    # --- episode control ---------------------------------------------------------------------

    async def reset(self, task: Task) -> Observation:
        from tau2.data_model.message import AssistantMessage

        if task.env != self.name:
            raise ValueError(f"Tau2Env({self.domain}) got a task for '{task.env}'")
        if self.user_sim is None:
            raise ValueError("Tau2Env needs a user simulator: Tau2Env(domain, user_sim=UserSimulator(config))")
        self._task = task
        self._tau2_task = tau2_task(self.domain, task.payload.get("tau2_id") or task.task_id.split("/", 1)[1])
        # Building the domain DB takes ~0.1 s of CPU: keep it off the event loop.
        self._env = await asyncio.to_thread(self._build_environment)
        self._tools = [t.openai_schema for t in self._env.get_tools()]
        self._user_tools = [t.openai_schema for t in self._env.get_user_tools()] if self._env.user_tools else None
        if self.config.prompts == "tau2":
            system = tau2_agent_system_prompt(self._env)
            self._user_prompt = tau2_user_system_prompt(self._tau2_task, self._env)
        else:
            system = agent_system_prompt(self._env.get_policy())
            self._user_prompt = build_user_system_prompt(self._tau2_task.user_scenario, with_tools=bool(self._user_tools))
        self._messages = [
            {"role": "system", "content": system},
            {"role": "assistant", "content": GREETING},
        ]
        self._user_view = [{"role": "user", "content": GREETING}]  # the simulator's side, roles flipped
        self._trajectory = [AssistantMessage(role="assistant", content=GREETING)]
        self._steps = self._errors = self._decisions = self._calls = 0
        self._done, self._termination, self._end_reason = False, None, ""
        await self._user_turn()
        return self._observation()

    async def step(self, action: Action | Reply) -> tuple[Observation, bool]:
        check_step(action, started=self._task is not None, done=self._done, parallel=True)
        self._decisions += 1
        if isinstance(action, (ToolCall, ToolCalls)):
            self._agent_tool_calls(action.calls if isinstance(action, ToolCalls) else (action,))
        elif isinstance(action, Invalid) or not action.text.strip():
            self._messages.append(assistant_message(action, call_id=""))
            self._terminate("agent_error", "invalid agent reply")
        else:
            await self._agent_message(action.text)
        limit = self.config.max_decisions
        if not self._done and limit is not None and self._decisions >= limit:
            self._terminate("max_steps", "decision_limit")
        return self._observation(), self._done

    def _build_environment(self):
        env = environment_constructor(self.domain)()
        state = self._tau2_task.initial_state
        env.set_state(
            initialization_data=state.initialization_data if state else None,
            initialization_actions=state.initialization_actions if state else None,
            message_history=[],
        )
        return env

    def end(self, reason: str) -> Observation:
        if self._task is None:
            raise EnvError("call reset(task) before end()")
        if not self._done:
            self._terminate("agent_error", reason)
        return self._observation()

    def score(self) -> dict[str, Any]:
        if self._task is None:
            raise EnvError("nothing to score: call reset(task) and run an episode first")
        out = score_tau2(self.domain, self._tau2_task, self._trajectory, self._termination)
        out["end_reason"] = self._end_reason or "running"
        return out

    # --- agent side --------------------------------------------------------------------------

    def _agent_tool_calls(self, calls: tuple[ToolCall, ...]) -> None:
        from tau2.data_model.message import AssistantMessage
        from tau2.data_model.message import ToolCall as Tau2ToolCall

        ids = [f"call_{self._calls + k}" for k in range(len(calls))]
        self._calls += len(calls)
        self._messages.append(calls_to_assistant_message(calls, ids))
        self._tick(to_env=True)
        # Calls rejected before execution never touch the DB, so the hidden trajectory (which
        # the evaluator replays) holds only the ones that ran, in one assistant message.
        problems = [check_tool_call(call, self._tools) for call in calls]
        records = [Tau2ToolCall(id=call_id, name=call.name, arguments=copy.deepcopy(call.arguments), requestor="assistant")
                   for call, call_id, problem in zip(calls, ids, problems) if problem is None]
        if records:
            self._trajectory.append(AssistantMessage(role="assistant", content=None, tool_calls=records))
        runs = iter(records)
        transferred = False
        for call, call_id, problem in zip(calls, ids, problems):
            if problem is not None:
                content, error = f"Error: {problem}", True
            else:
                response = self._env.get_response(next(runs).model_copy(deep=True))
                self._trajectory.append(response)
                content, error = response.content or "", response.error
                transferred |= not error and call.name == TRANSFER_TOOL
            self._messages.append(tool_message(call_id, call.name, content))
            self._errors += int(error)
        self._tick(to_env=False)
        if not self._done and transferred and self.config.end_on_transfer:
            self._terminate("agent_stop", "transfer")

    async def _agent_message(self, text: str) -> None:
        from tau2.data_model.message import AssistantMessage

        self._messages.append({"role": "assistant", "content": text})
        self._trajectory.append(AssistantMessage(role="assistant", content=text))
        self._user_view.append({"role": "user", "content": text})
        self._tick(to_env=False)
        if not self._done:
            await self._user_turn()

    # --- user side ---------------------------------------------------------------------------

    async def _user_turn(self) -> None:
        """Ask the simulator until it says something to the agent (running its device tools
        in between), or the episode ends."""
        from tau2.data_model.message import UserMessage

        for _ in range(self.config.max_user_tool_rounds + 1):
            # a UserSimUnavailable (the user's endpoint failed past its retries) propagates: the
            # episode is no score and no finished episode (issue 43), never a user_error scored 0
            reply = await self.user_sim.reply(self._user_prompt, self._user_view, self._user_tools,
                                              seed=self.config.user_seed)
            if reply.tool_calls and self._user_tools:
                self._user_tool_calls(reply.tool_calls)
                if self._done:
                    return
                continue
            text = reply.text or ""
            if not text:  # tool calls without device tools: nothing the agent can see
                self._terminate("user_error", "user simulator called tools it does not have")
                return
            self._trajectory.append(UserMessage(role="user", content=text))
            self._user_view.append({"role": "assistant", "content": text})
            self._messages.append({"role": "user", "content": text})
            signal = has_signal(text)
            if signal:
                self._terminate("user_stop", f"user_signal:{signal.strip('#').lower()}")
            self._tick(to_env=False)
            return
        self._terminate("user_error", "user simulator kept calling tools")

    def _user_tool_calls(self, requests) -> None:
        from tau2.data_model.message import ToolCall as Tau2ToolCall
        from tau2.data_model.message import UserMessage

        records, view_calls, results = [], [], []
        for req in requests:
            view_calls.append({"id": req.call_id, "type": "function", "function": {"name": req.name, "arguments": req.raw_arguments}})
            problem = "arguments must be a JSON object" if req.arguments is None else check_tool_call(
                ToolCall(req.name, req.arguments), self._user_tools)
            if problem is None:
                records.append(Tau2ToolCall(id=req.call_id, name=req.name, arguments=copy.deepcopy(req.arguments), requestor="user"))
                results.append(None)
            else:
                results.append(f"Error: {problem}")
        self._user_view.append({"role": "assistant", "content": "", "tool_calls": view_calls})
        if records:
            self._trajectory.append(UserMessage(role="user", content=None, tool_calls=records))
        self._tick(to_env=True)
        responses = iter([self._env.get_response(r.model_copy(deep=True)) for r in records])
        for req, result in zip(requests, results):
            if result is None:
                response = next(responses)
                self._trajectory.append(response)
                result, error = response.content or "", response.error
            else:
                error = True
            self._errors += int(error)
            self._user_view.append({"role": "tool", "tool_call_id": req.call_id, "content": result})
        self._tick(to_env=False)

    # --- bookkeeping -------------------------------------------------------------------------

    def _tick(self, *, to_env: bool) -> None:
        """One orchestrator message. Budgets are checked only when the next message is not
        addressed to the environment, as in the package."""
        self._steps += 1
        if to_env:
            return
        if self._steps >= self.config.max_steps:
            self._terminate("max_steps", "step_limit", override=True)
        elif self._errors >= self.config.max_errors:
            self._terminate("too_many_errors", "too_many_errors", override=True)

    def _terminate(self, termination: str, reason: str, *, override: bool = False) -> None:
        if self._done and not override:
            return
        self._done, self._termination, self._end_reason = True, termination, reason

    def _observation(self) -> Observation:
        info: dict[str, Any] = {"domain": self.domain, "decisions": self._decisions}
        if self._done:
            info["end_reason"] = self._end_reason
        return Observation(messages=[dict(m) for m in self._messages], tools=list(self._tools), done=self._done, info=info)
