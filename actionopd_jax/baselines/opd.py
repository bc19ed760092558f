"""Token-level on-policy distillation (OPD) baseline, paper B.4 "sampled-token reverse-KL".

Per step: for every task start, `collect.num_candidates` independent student trajectories
(paper: four) are rolled out with the behaviour snapshot, one sample per state; the teacher
then scores each sampled token at its prefix (log pi_T(y_l | s, y_<l)) and the update uses the
per-token signal log pi_T - log pi_old in the shared clipped surrogate (`train.loss=opd`,
train/losses.opd_sums). Teacher and student must share a token space.

Teacher log-probabilities come from a `Scorer`:
- `LocalTeacherScorer`: another Qwen3 in process (a forward pass over prompt + response);
- `EndpointScorer`: an OpenAI-compatible server through vLLM-style echo scoring
  (`/v1/completions`, token-id prompt, max_tokens 0, echo, logprobs) -- vLLM or our own
  server (serve/scoring.py), with the same client code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import jax
import numpy as np

from actionopd_jax import paid_calls
from actionopd_jax.collect import keys
from actionopd_jax.types import Action, Candidate, StateGroup, Task

log = logging.getLogger(__name__)

OPD_PURPOSE = 16  # fold_in offset for trajectory j of a task start (distinct from collect.keys purposes)


class Scorer(Protocol):
    def score(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Teacher log-probabilities of each response token given the prompt and the earlier tokens."""
        ...


class LocalTeacherScorer:
    """A Flax teacher in process; rows are scored `max_rows` at a time."""

    def __init__(self, model: Any, *, mesh: Any = None, temperature: float = 1.0, max_rows: int = 8):
        from actionopd_jax.serve.scoring import TokenScorer

        self.scorer = TokenScorer(model, mesh=mesh, temperature=temperature)
        self.max_rows = max_rows

    def score(self, prompts, responses) -> list[np.ndarray]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
        result: dict[int, np.ndarray] = {}
        for a in range(0, len(order), self.max_rows):
            chunk = order[a:a + self.max_rows]
            scored = self.scorer.response_logprobs([prompts[i] for i in chunk], [responses[i] for i in chunk])
            result.update(zip(chunk, scored))
        return [result[i] for i in range(len(prompts))]


class EndpointScorer:
    """Echo scoring over HTTP with the real `openai` client:
    completions.create(prompt=<token ids>, max_tokens=0, echo=True, logprobs=1)."""

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None, concurrency: int = 16,
                 timeout_s: float = 600.0, max_retries: int = 4):
        key = os.environ.get(api_key_env, "") if api_key_env else "unused"
        if api_key_env and not key:
            raise ValueError(f"environment variable {api_key_env} (the scoring endpoint's API key) is not set")
        self.base_url, self.model, self._key = base_url, model, key
        self.concurrency, self.timeout_s, self.max_retries = concurrency, timeout_s, max_retries

    async def score_async(self, prompts, responses) -> list[np.ndarray]:
        import openai

        client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self._key, timeout=self.timeout_s,
                                    max_retries=self.max_retries)
        sem = asyncio.Semaphore(max(1, self.concurrency))

        async def one(prompt: np.ndarray, response: np.ndarray) -> np.ndarray:
            ids = [int(t) for t in np.concatenate([prompt, response])]
            ledger = paid_calls.current()
            async with sem:
                # run.budget_* (paid_calls.py): the prompt is token ids, so its size is known exactly;
                # one output token is held in case the server generates one despite max_tokens=0
                with ledger.holding("teacher", len(ids), replies=1, max_tokens=1) if ledger else contextlib.nullcontext():
                    r = await client.completions.create(model=self.model, prompt=ids, max_tokens=0, echo=True,
                                                        logprobs=1, temperature=1.0)
                    if ledger is not None:
                        used = getattr(r, "usage", None)
                        ledger.record("teacher", requests=1,
                                      prompt_tokens=int(getattr(used, "prompt_tokens", 0) or 0) or len(ids),
                                      completion_tokens=int(getattr(used, "completion_tokens", 0) or 0))
            lps = (r.choices[0].logprobs.token_logprobs if r.choices and r.choices[0].logprobs else None) or []
            if len(lps) < len(ids):
                raise RuntimeError(f"scoring endpoint returned {len(lps)} prompt logprobs for {len(ids)} tokens "
                                   "(does it support echo with max_tokens=0 on token-id prompts?)")
            part = lps[len(prompt):len(ids)]
            if any(x is None for x in part):
                raise RuntimeError("scoring endpoint left a response token without a logprob")
            return np.asarray(part, np.float32)

        try:
            return list(await asyncio.gather(*(one(p, r) for p, r in zip(prompts, responses))))
        except openai.APIError as e:   # past the client's own retries: an outage stops the run, named
            from actionopd_jax.train.sources import RunStop

            raise RunStop(f"OPD: the teacher scoring endpoint {self.base_url} (model {self.model}) failed: "
                          f"{type(e).__name__}: {str(e)[:300]} (one of {len(prompts)} scoring request(s) of this "
                          f"step, after {self.max_retries} retries each). It is down, or teacher.base_url / "
                          "teacher.model / its API key are wrong. Fix it and rerun the command: the run resumes "
                          "from its last checkpoint") from None
        finally:
            await client.close()

    def score(self, prompts, responses) -> list[np.ndarray]:
        return asyncio.run(self.score_async(prompts, responses))


# --- student rollouts -----------------------------------------------------------------------------

@dataclass
class StudentState:
    prompt_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    text: str
    action: Action
    finish_reason: str


@dataclass
class StudentTrajectory:
    task_start: int
    index: int  # which of the task start's trajectories
    task: Task
    states: list[StudentState] = field(default_factory=list)
    end_reason: str = ""
    score: dict[str, Any] = field(default_factory=dict)


def trajectory_key(seed: int, step: int, task_start: int, trajectory: int, decision: int) -> jax.Array:
    return jax.random.fold_in(keys.state_key(seed, step, task_start, decision), OPD_PURPOSE + trajectory)


async def run_student_trajectory(task: Task, start: int, index: int, *, step: int, seed: int, worker: Any,
                                 prompts: Any, decoder: Any, env_factory: Any, limit: int | None,
                                 env_timeout_s: float = 600.0) -> StudentTrajectory:
    """One student episode: at each state one sample from the behaviour snapshot; the parsed
    action steps the environment (Invalid too: the environment shows an empty turn)."""
    traj = StudentTrajectory(task_start=start, index=index, task=task)
    env = env_factory(task)
    try:
        obs = await asyncio.wait_for(env.reset(task), env_timeout_s)
        while True:
            if obs.done:
                traj.end_reason = "env_done"
                break
            if limit is not None and len(traj.states) >= limit:
                traj.end_reason = "decision_limit"
                env.end("decision_limit")
                break
            prompt = prompts.build(obs.messages, obs.tools)
            if prompt is None:
                traj.end_reason = "context_overflow"
                env.end("context_overflow")
                break
            (gen,) = await worker.sample(prompt.ids, trajectory_key(seed, step, start, index, len(traj.states)))
            text = decoder.text(gen.token_ids)
            action = decoder.action(text, prompt.tools, gen.finish_reason)
            traj.states.append(StudentState(np.asarray(prompt.ids, np.int32), np.asarray(gen.token_ids, np.int32),
                                            np.asarray(gen.logprobs, np.float32), text, action, gen.finish_reason))
            result = await asyncio.wait_for(env.step(action), env_timeout_s)
            obs = result[0] if isinstance(result, tuple) else result
    except Exception as err:  # noqa: BLE001 - one broken episode keeps the states it produced
        from actionopd_jax.collect.sampler_worker import SamplerError

        if isinstance(err, SamplerError):
            raise
        traj.end_reason = f"error:{type(err).__name__}"
        log.warning("OPD trajectory %s/%d failed: %s", task.task_id, index, err)
    try:
        traj.score = dict(env.score())
    except Exception as err:  # noqa: BLE001
        traj.score = {"reward": float("nan"), "score_error": f"{type(err).__name__}: {err}"}
    return traj


def groups_from_trajectories(trajectories: Sequence[StudentTrajectory], teacher_logprobs: Sequence[np.ndarray]
                             ) -> list[StateGroup]:
    """Every state is a one-candidate group carrying the teacher's logprobs of its tokens."""
    states = [(t, i, s) for t in trajectories for i, s in enumerate(t.states)]
    if len(states) != len(teacher_logprobs):
        raise ValueError(f"{len(teacher_logprobs)} teacher score arrays for {len(states)} states")
    groups = []
    for (traj, i, s), lp in zip(states, teacher_logprobs):
        lp = np.asarray(lp, np.float32)
        if lp.shape != s.token_ids.shape:
            raise ValueError(f"teacher scored {lp.size} tokens of a {s.token_ids.size}-token response")
        cand = Candidate(token_ids=s.token_ids, logprobs=s.logprobs, text=s.text, action=s.action,
                         finish_reason=s.finish_reason, teacher_logprobs=lp)
        groups.append(StateGroup(task_id=traj.task.task_id, decision_index=i, prompt_ids=s.prompt_ids,
                                 candidates=[cand], teacher_samples=[], committed_index=0, retained=True))
    return groups
