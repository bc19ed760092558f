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
from actionopd_jax.types import Action, Invalid, Observation, Task


class ContextTooLong(Exception):
    """The prompt does not fit the agent's context: the episode ends, nothing is fabricated."""


class AgentUnavailable(Exception):
    """The agent could not answer (API down, rate limited past all retries). The episode is
    not recorded as finished, so a resumed evaluation runs it again."""


class Agent(Protocol):
    name: str

    async def act(self, obs: Observation, *, task: Task, trial: int) -> Action: ...


class EndpointAgent:
    """A model behind an OpenAI-compatible endpoint. `retries`: extra requests for a reply with
    no choice, or (`retry_invalid`) whose action does not parse: a teacher gets them, as the
    collector's teacher client does (teacher.retries); a student under evaluation does not (its
    invalid reply is its answer). A reply still without a choice is AgentUnavailable (the
    episode is not recorded, a resumed run plays it again)."""

    # native parallel function calling (module docstring); False: N calls are one Invalid reply
    parallel_calls = True

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None, temperature: float | None = 0.0,
                 max_tokens: int = 1024, extra_body: dict[str, Any] | None = None, timeout_s: float = 300.0,
                 retries: int = 0, retry_invalid: bool = False, provider: str = "openai", top_p: float | None = None,
                 top_k: int | None = None, thinking: bool | None = None, reasoning_effort: str | None = None):
        import openai

        # the body's sampling fields, spelled for `provider` (providers.py); a setting the
        # provider has no field for is refused here (UnsendableSetting), before any request
        self._sampling = sampling_body(provider, temperature=temperature, top_p=top_p, top_k=top_k,
                                       max_tokens=max_tokens, reasoning_effort=reasoning_effort or None,
                                       thinking=thinking, extra_body=extra_body, who="evaluated endpoint")
        key = os.environ.get(api_key_env, "") if api_key_env else "unused"
        if api_key_env and not key:
            raise ValueError(f"environment variable {api_key_env} (the endpoint's API key) is not set")
        self._client = openai.AsyncOpenAI(base_url=base_url, api_key=key, timeout=timeout_s, max_retries=4)
        self.name = model
        self._model = model
        self._retries, self._retry_invalid = max(0, int(retries)), retry_invalid

    async def act(self, obs: Observation, *, task: Task, trial: int) -> Action:
        return (await self.act_detailed(obs, task=task, trial=trial))[0]

    async def act_detailed(self, obs: Observation, *, task: Task, trial: int) -> tuple[Action, str]:
        """(action, the reply's reasoning_content or ""): KD imitates the reasoning too."""
        for attempt in range(self._retries + 1):
            # a retry asks with another seed: a seeded server would repeat the same reply
            got = await self._ask(obs, trial if attempt == 0 else trial + 1_000_003 * attempt)
            last = attempt == self._retries
            if got is None:
                if last:
                    raise AgentUnavailable(f"endpoint returned no choices ({self._retries + 1} request(s))")
                continue
            action, reasoning = got
            if isinstance(action, Invalid) and self._retry_invalid and not last:
                continue
            return action, reasoning
        raise AssertionError("unreachable")

    async def _ask(self, obs: Observation, seed: int) -> tuple[Action, str] | None:
        import openai

        try:
            r = await self._client.chat.completions.create(
                model=self._model, messages=obs.messages, tools=obs.tools or openai.omit, seed=seed,
                **self._sampling)
        except openai.BadRequestError as e:
            if "context" in str(e).lower():
                raise ContextTooLong(str(e)) from e
            raise AgentUnavailable(f"endpoint rejected the request: {e}") from e
        except openai.APIError as e:
            raise AgentUnavailable(f"endpoint failed: {type(e).__name__}: {e}") from e
        if not r.choices or r.choices[0].message is None:
            return None
        message = r.choices[0].message
        reasoning = getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning_content")
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
