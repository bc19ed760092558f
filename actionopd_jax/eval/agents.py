"""Agents the harness can evaluate. Each turns a public observation into one action.

- `EndpointAgent`: any OpenAI-compatible endpoint (a hosted teacher, vLLM, or our own server),
  so teachers and students go through the same harness, as in the paper's table 1.
- `BackendAgent`: one of our backends in process (a checkpoint on device), no HTTP.
- `ReferenceAgent`: the privileged reference policy built from the dataset's ground truth;
  a check of the harness itself, never a baseline.
Replies are read with the student's rules, whoever produced them, except that with
`parallel_calls` (the default: native function calling, as the paper evaluates and as BFCL's
and tau2's own runners do) a reply with N tool calls is one `ToolCalls` reply that runs all N.
KD's teacher agent turns it off: its episodes become training targets, and training keeps one
action per decision.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from actionopd_jax.chat import action_from_openai_message
from actionopd_jax.providers import sampling_body
from actionopd_jax.serve.requests import ChatRequest, RequestError
from actionopd_jax.teacher.base import UsageReport
from actionopd_jax.teacher.transport import PermanentRequestError, RetryPolicy, TransportGaveUp
from actionopd_jax.types import Action, Invalid, Observation, Task


class ContextTooLong(Exception):
    """The prompt does not fit the agent's context: the episode ends, nothing is fabricated."""


class AgentUnavailable(Exception):
    """The agent could not answer (API down, rate limited past all retries). The episode is
    not recorded as finished, so a resumed evaluation runs it again. `where` names the
    endpoint (URL and model) for the outage message."""

    def __init__(self, message: str, *, where: str = ""):
        super().__init__(message)
        self.where = where


class Agent(Protocol):
    name: str

    async def act(self, obs: Observation, *, task: Task, trial: int) -> Action: ...


class EndpointAgent:
    """A model behind an OpenAI-compatible endpoint, through the collector's teacher client
    (`teacher.endpoint.ChatEndpoint`): the same transport retries (429 / 5xx / timeouts /
    connection errors, and HTTP 200 bodies that are no usable completion), the same provider
    spelling, the same counts (`usage`: requests, retries, malformed bodies, tokens).

    `retries`: extra requests for a reply whose action does not parse (`retry_invalid`): a
    teacher gets them, as the collector's teacher client does (teacher.retries); a student
    under evaluation does not (its invalid reply is its answer). When the transport retries run
    out the agent is AgentUnavailable, naming the endpoint (URL, model), the error class and the
    attempts: the episode is not recorded, a resumed run plays it again."""

    # native parallel function calling (module docstring); False: N calls are one Invalid reply
    parallel_calls = True

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None, temperature: float | None = 0.0,
                 max_tokens: int = 1024, extra_body: dict[str, Any] | None = None, timeout_s: float = 300.0,
                 retries: int = 0, retry_invalid: bool = False, provider: str = "openai", top_p: float | None = None,
                 top_k: int | None = None, thinking: bool | None = None, reasoning_effort: str | None = None,
                 retry: RetryPolicy | None = None, role: str = "agent"):
        from actionopd_jax.teacher.endpoint import ChatEndpoint, EndpointSettings

        # the body's sampling fields, spelled for `provider` (providers.py); a setting the
        # provider has no field for is refused here (UnsendableSetting), before any request
        sampling_body(provider, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                      reasoning_effort=reasoning_effort or None, thinking=thinking, extra_body=extra_body,
                      who="evaluated endpoint")
        if api_key_env and not os.environ.get(api_key_env, ""):
            raise ValueError(f"environment variable {api_key_env} (the endpoint's API key) is not set")
        settings = EndpointSettings(model=model, base_url=base_url, provider=provider, api_key_env=api_key_env or None,
                                    thinking=thinking, reasoning_effort=reasoning_effort or None,
                                    temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                    extra_body=dict(extra_body or {}), request_timeout_s=timeout_s,
                                    retry=retry or RetryPolicy(), max_concurrency=1 << 16)
        # metered as the ledger's "teacher" role: the model asked for actions (paid_calls.py)
        self.endpoint = ChatEndpoint(settings, who=f"{role} {model} at {base_url}", paid_role="teacher")
        self.name = model
        self.where = f"{role} endpoint {base_url} (model {model})"   # what an outage message names
        self._retries, self._retry_invalid = max(0, int(retries)), retry_invalid

    @property
    def usage(self) -> UsageReport:
        """Requests, transport retries, malformed bodies and tokens of this agent so far."""
        return self.endpoint.usage

    async def act(self, obs: Observation, *, task: Task, trial: int) -> Action:
        return (await self.act_detailed(obs, task=task, trial=trial))[0]

    async def act_detailed(self, obs: Observation, *, task: Task, trial: int) -> tuple[Action, str]:
        """(action, the reply's reasoning_content or ""): KD imitates the reasoning too."""
        for attempt in range(self._retries + 1):
            # a retry asks with another seed: a seeded server would repeat the same reply
            action, reasoning = await self._ask(obs, trial if attempt == 0 else trial + 1_000_003 * attempt)
            if isinstance(action, Invalid) and self._retry_invalid and attempt < self._retries:
                continue
            return action, reasoning
        raise AssertionError("unreachable")

    async def _ask(self, obs: Observation, seed: int) -> tuple[Action, str]:
        try:
            choices = await self.endpoint.complete(obs.messages, obs.tools or None, 1, seed=seed)
        except PermanentRequestError as e:
            if "context" in str(e).lower():
                raise ContextTooLong(str(e)) from e
            kind = type(e.__context__).__name__ if e.__context__ is not None else "refused"  # the SDK's class
            raise AgentUnavailable(f"{self.where} refused the request ({kind}): {e}", where=self.where) from e
        except TransportGaveUp as e:
            u = self.usage
            raise AgentUnavailable(f"{self.where}: {e} ({u.http_calls} request(s) by this agent so far, "
                                   f"{u.malformed_replies} malformed repl(ies))", where=self.where) from e
        message = choices[0]["message"]
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        action = action_from_openai_message(message, obs.tools, role="student",
                                            parallel=self.parallel_calls)
        return action, reasoning if isinstance(reasoning, str) else ""


async def backend_choice(backend: Any, model: str, obs: Observation, *, temperature: float, max_tokens: int,
                         seed: int, top_p: float = 1.0, top_k: int = 0) -> Any:
    """The first choice of one chat request for `obs` to an in-process backend, its errors
    mapped to the agent errors (ContextTooLong, AgentUnavailable). Shared by every agent that
    calls a backend, so they ask and fail the same way."""
    req = ChatRequest(model=model, messages=obs.messages, tools=obs.tools or None, tool_choice="auto",
                      temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed)
    try:
        choices, _ = await backend.complete(req)
    except RequestError as e:
        if "context" in e.message.lower():
            raise ContextTooLong(e.message) from e
        raise AgentUnavailable(e.message) from e
    return choices[0]


class BackendAgent:
    """A backend (e.g. the model backend over a checkpoint) called in process."""

    parallel_calls = True  # as EndpointAgent's

    def __init__(self, backend: Any, *, temperature: float = 0.0, max_tokens: int = 1024, top_p: float | None = None,
                 top_k: int | None = None):
        self._backend = backend
        self.name = backend.model_name
        self._temperature, self._max_tokens = temperature, max_tokens
        self._top_p, self._top_k = 1.0 if top_p is None else top_p, top_k or 0

    async def act(self, obs: Observation, *, task: Task, trial: int) -> Action:
        return (await self.act_detailed(obs, task=task, trial=trial))[0]

    async def act_detailed(self, obs: Observation, *, task: Task, trial: int) -> tuple[Action, str]:
        c = await backend_choice(self._backend, self.name, obs, temperature=self._temperature,
                                 max_tokens=self._max_tokens, seed=trial, top_p=self._top_p, top_k=self._top_k)
        message = {"role": "assistant", "content": c.content, "tool_calls": c.tool_calls}
        return (action_from_openai_message(message, obs.tools, role="student",
                                           parallel=self.parallel_calls),
                c.reasoning_content or "")


class ReferenceAgent:
    """The dataset's ground truth replayed as a policy (privileged: it reads the solution)."""

    name = "reference-policy (privileged)"

    def __init__(self) -> None:
        self._policies: dict[tuple[str, int], Any] = {}

    async def act(self, obs: Observation, *, task: Task, trial: int) -> Action:
        from actionopd_jax.envs.reference import reference_policy

        policy = self._policies.get((task.task_id, trial))
        if policy is None:
            policy = self._policies[(task.task_id, trial)] = reference_policy(task)
        return policy.next_action(obs)
