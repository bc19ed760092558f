"""An EnvScaler scenario as an `Environment` (`env.name: envscaler`).

Each episode runs the scenario's environment class in its own sandboxed process
(`Sandbox.open_class`: scrubbed environment, private directory, rlimits; envs/sandbox.py),
built from the task's initial state. The agent sees our system prompt with the environment's
introduction and rules, and the class's tools.

- Non-conversational: the task text is the user turn; the agent's first text reply ends the
  episode ("completed").
- Conversational: our LLM user simulator (envs/user_sim.py, over HTTP) plays the user from the
  task goal: it answers the agent's greeting, each agent text goes to it, and its reply is the
  next user turn; its stop marker ends the episode ("user_stop").

A tool call is checked against the tool's schema (names and shape, as the published harness
passes values through untyped) and runs as the instance's method; the agent sees `str()` of
the result. A method that raises becomes an "Error: ..." tool message and the episode goes
on (upstream ends the episode there; the generated classes are written never to raise, so a
raise is mostly a bad argument value the agent can correct). A fault of the sandboxed process
(it died, hung past the call timeout, or answered garbage) ends the episode: `step` raises
`EnvScalerFault`, whose `end_reason` the collector records; other episodes are unaffected.

Success comes from the scenario's check functions on the final state (envs/envscaler/check.py):
`reward` is the fraction of checks passed, `success` whether all passed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actionopd_jax.envs.base import EnvError, assistant_message, check_step, tool_message
from actionopd_jax.envs.envscaler.check import CheckOutcome, score_state
from actionopd_jax.envs.envscaler.layout import EnvScalerScenario, initial_messages
from actionopd_jax.envs.envscaler.user import GREETING, user_system_prompt
from actionopd_jax.envs.sandbox import ClassSession, Sandbox, SandboxError
from actionopd_jax.envs.tool_args import check_tool_call
from actionopd_jax.envs.user_sim import STOP, UserSimulator, UserSimUnavailable
from actionopd_jax.types import Action, Invalid, Observation, Task, ToolCall


# Sandbox calls block on a child process: run them on threads of our own, enough for every
# episode in flight, so that a hanging call (up to its timeout) never starves the others or
# asyncio's small default pool.
_EXECUTOR = ThreadPoolExecutor(max_workers=64, thread_name_prefix="envscaler")


async def _off_loop(fn, *args, **kwargs):
    return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, functools.partial(fn, *args, **kwargs))


class EnvScalerFault(RuntimeError):
    """The environment's process failed; `end_reason` is what the trajectory records."""

    def __init__(self, end_reason: str, detail: str):
        super().__init__(f"{end_reason}: {detail}")
        self.end_reason = end_reason
        self.detail = detail


def _fault_reason(err: SandboxError) -> str:
    text = str(err)
    if text.startswith("timeout"):
        return "envscaler_timeout"
    if "malformed" in text:
        return "envscaler_malformed_reply"
    return "envscaler_died"


@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
    call_timeout_s: float = 30.0  # wall clock per tool call (and for starting the class)
    check_timeout_s: float = 10.0  # per check function
    max_tool_calls: int = 40
    max_user_turns: int = 20  # simulator replies per conversational episode
    user_seed: int | None = None


def scenario_of(task: Task) -> EnvScalerScenario:
    p = task.payload or {}
    missing = [k for k in ("class_code", "class_name", "init_config", "checks", "tools") if k not in p]
    if missing:
        raise ValueError(f"EnvScaler task {task.task_id}: its payload lacks {missing}; load tasks with "
                         "envs.envscaler.layout.load_envscaler(DIR).tasks()")
    return EnvScalerScenario(task_id=task.task_id, env_id=p.get("env_id", ""), class_name=p["class_name"],
                             init_config=p["init_config"], task=p.get("task", ""), checks=p["checks"],
                             conversational=bool(p.get("conversational")))


class EnvScalerEnvironment:
    name = "envscaler"

    def __init__(self, sandbox: Sandbox, *, user_sim: UserSimulator | None = None,
                 config: EpisodeConfig | None = None):
        self.sandbox = sandbox
        self.user_sim = user_sim
        self.config = config or EpisodeConfig()
        self._task: Task | None = None
        self._session: ClassSession | None = None
        self._done = False

    # --- episode control ---------------------------------------------------------------------

    async def reset(self, task: Task) -> Observation:
        self._close()
        scenario = scenario_of(task)
        if scenario.conversational and self.user_sim is None:
            raise ValueError(f"EnvScaler task {task.task_id} is conversational: it needs a user simulator "
                             "(set env.user_model and env.user_base_url)")
        self._task, self._scenario = task, scenario
        self._tools = list(task.payload["tools"])
        self._done, self._end_reason, self._fault = False, "", ""
        self._calls = self._errors = self._user_turns = 0
        self._outcome: CheckOutcome | None = None
        self._final_state: dict[str, Any] | None = None
        self._messages = initial_messages(task)[:1]  # the system prompt; the user turn follows
        try:
            self._session = await _off_loop(
                self.sandbox.open_class, task.payload["class_code"], scenario.class_name, scenario.init_config,
                timeout_s=self.config.call_timeout_s)
            self._initial_state = await _off_loop(self._session.state)
        except SandboxError as err:
            self._finish("envscaler_start_failed", fault=str(err))
            raise EnvScalerFault("envscaler_start_failed", str(err)) from None
        if scenario.conversational:
            self._user_view = [{"role": "user", "content": GREETING}]  # the simulator's side, roles flipped
            self._user_prompt = user_system_prompt(scenario.task)
            await self._user_turn()
        else:
            self._messages.append({"role": "user", "content": scenario.task})
        return self._observation()

    async def step(self, action: Action) -> tuple[Observation, bool]:
        check_step(action, started=self._task is not None, done=self._done)
        if isinstance(action, ToolCall):
            await self._tool_call(action)
        elif isinstance(action, Invalid) or not action.text.strip():
            self._messages.append(assistant_message(action, call_id=""))
            self._finish("invalid_reply")
        else:
            self._messages.append({"role": "assistant", "content": action.text})
            if self._scenario.conversational:
                self._user_view.append({"role": "user", "content": action.text})
                await self._user_turn()
            else:
                self._finish("completed")
        if self._done and self._outcome is None and self._session is not None:
            await _off_loop(self._score_now)  # check functions run off the event loop
        return self._observation(), self._done

    async def fork_point(self):
        """The live state as a fork point for the matcher's execution stage (envs/fork.py,
        envscaler/fork.py), or None when there is nothing to fork (no episode running, or it
        ended). Reading the state is the only thing it asks of the live instance."""
        if self._task is None or self._done or self._session is None:
            return None
        from actionopd_jax.envs.envscaler.fork import ClassForkPoint
        from actionopd_jax.envs.fork import FixedEffects, tool_effects_of

        faithful = getattr(self._session, "state_is_json", None)
        if not callable(faithful):
            return None  # a sandbox that cannot say whether its state copies exactly: no forks
        try:
            if not await _off_loop(faithful):
                return None  # a set, tuple, datetime or int key would not survive the copy
            before = await _off_loop(self._session.state)
        except SandboxError:
            return None  # the live process is in trouble: the episode's own next step will say so
        return ClassForkPoint(self.sandbox, self._task.payload["class_code"], self._scenario.class_name, before,
                              self._tools, FixedEffects(tool_effects_of(self._task)),
                              timeout_s=self.config.call_timeout_s, run_off_loop=_off_loop)

    def end(self, reason: str) -> Observation:
        if self._task is None:
            raise EnvError("call reset(task) before end()")
        if not self._done:
            self._finish(reason)
        return self._observation()

    def score(self) -> dict[str, Any]:
        if self._task is None:
            raise EnvError("nothing to score: call reset(task) and run an episode first")
        if self._outcome is None and self._session is not None:
            self._score_now()
        out: dict[str, Any] = {"reward": 0.0, "success": False, "end_reason": self._end_reason or "running",
                               "tool_calls": self._calls, "tool_errors": self._errors}
        if self._outcome is not None:
            out.update(reward=self._outcome.reward, success=self._outcome.success, checks=self._outcome.results)
        if self._fault:
            out["fault"] = self._fault
        return out

    def __del__(self) -> None:
        try:
            self._close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # --- internals ---------------------------------------------------------------------------

    async def _tool_call(self, call: ToolCall) -> None:
        call_id = f"call_{self._calls}"
        self._calls += 1
        self._messages.append(assistant_message(call, call_id))
        problem = check_tool_call(call, self._tools, check_types=False)
        if problem is not None:
            text = f"Error: {problem}"
            self._errors += 1
        else:
            try:
                text = await _off_loop(self._session.call, call.name, call.arguments)
            except SandboxError as err:
                if err.fatal:
                    reason = _fault_reason(err)
                    self._finish(reason, fault=str(err))
                    raise EnvScalerFault(reason, str(err)) from None
                text, self._errors = f"Error: {err}", self._errors + 1
        self._messages.append(tool_message(call_id, call.name, text))
        if self._calls >= self.config.max_tool_calls:
            self._finish("tool_call_limit")

    async def _user_turn(self) -> None:
        if self._user_turns >= self.config.max_user_turns:
            self._finish("user_turn_limit")
            return
        self._user_turns += 1
        try:
            reply = await self.user_sim.reply(self._user_prompt, self._user_view, None, seed=self.config.user_seed)
        except UserSimUnavailable as exc:
            # the user's endpoint failed past its retries: no score and no finished episode (issue
            # 43; eval reruns it on resume), so the instance ends unscored and the error goes on
            self._finish(f"user_sim_unavailable: {exc}", fault=str(exc))
            raise
        text = reply.text or ""
        if not text:
            self._finish("user_sim_unavailable: the simulator called tools instead of replying")
            return
        self._user_view.append({"role": "assistant", "content": text})
        self._messages.append({"role": "user", "content": text})
        if STOP in text:
            self._finish("user_stop")

    def _score_now(self) -> None:
        """Read the final state and run the checks; the instance's process then ends."""
        try:
            self._final_state = self._session.state()
        except SandboxError as err:
            self._fault = self._fault or str(err)
            self._close()
            return
        self._close()
        self._outcome = score_state(self._scenario, self._initial_state, self._final_state, sandbox=self.sandbox,
                                    timeout_s=self.config.check_timeout_s)

    def _finish(self, reason: str, *, fault: str = "") -> None:
        self._done, self._end_reason = True, reason
        if fault:
            self._fault = fault
            self._close()  # no state to score after a fault: the episode's reward is 0

    def _close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def _observation(self) -> Observation:
        info: dict[str, Any] = {"tool_calls": self._calls, "env_id": self._scenario.env_id}
        if self._done:
            info["end_reason"] = self._end_reason
        return Observation(messages=[dict(m) for m in self._messages], tools=list(self._tools),
                           done=self._done, info=info)
