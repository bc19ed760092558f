"""KD with fresh teacher trajectories every step, as paper B.4 runs it.

Per training step: the step's task starts (the same task stream and collect.task_starts_per_step
as ActionOPD; tau2: the per-domain quotas, 8 starts per domain in the paper's recipe), `trials`
(paper: 4) fresh teacher episodes per start, only the successful ones kept (score reward >=
kd.min_reward), and every assistant turn of a kept episode one example whose target is the
teacher's reasoning (when thinking is on) and action tokens through the end-of-turn token
(`kd.kd_examples`). The step's examples then train as one pass of minibatch updates with the
run's train.* settings, exactly as an ActionOPD step trains its rows: same optimizer, same
minibatch_rows, ppo_epochs, so the same number of updates per row.

Fresh means new samples: each episode asks the teacher with seed = step x trials + trial (the
OpenAI `seed` field), so a sampling teacher (or the self-disagreeing reference teacher) gives
new trajectories at every step; the episodes of each step are kept under
`<run>/kd/step-<n>.jsonl` (a resumed step reruns only the unfinished ones).

The recorded-file schedule (kd.trajectories: demonstrations collected once, `kd.KDGroupSource`)
stays available for offline data; it is not B.4's schedule.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from actionopd_jax.baselines.kd import KDExample, is_successful, kd_examples, teacher_trajectories
from actionopd_jax.types import Candidate, Message, StateGroup, Task

log = logging.getLogger(__name__)


class SeededTrials:
    """An eval agent whose trial t asks the inner agent as trial `offset + t`: the endpoint
    agent sends the trial as the request seed, so each step's episodes are new samples."""

    def __init__(self, inner: Any, offset: int):
        self.inner, self.offset = inner, int(offset)
        self.name = inner.name

    async def act(self, obs: Any, *, task: Task, trial: int) -> Any:
        return await self.inner.act(obs, task=task, trial=self.offset + trial)

    async def act_detailed(self, obs: Any, *, task: Task, trial: int) -> tuple[Any, str]:
        if hasattr(self.inner, "act_detailed"):
            return await self.inner.act_detailed(obs, task=task, trial=self.offset + trial)
        return await self.inner.act(obs, task=task, trial=self.offset + trial), ""


def example_group(ex: KDExample) -> StateGroup:
    """A one-candidate group whose candidate is the demonstration (the KD loss reads its tokens)."""
    cand = Candidate(token_ids=ex.target_ids, logprobs=np.zeros(ex.target_ids.size, np.float32), text="",
                     action=Message(""), reward=0.0)
    return StateGroup(task_id=ex.task_id, decision_index=ex.message_index, prompt_ids=ex.prompt_ids,
                      candidates=[cand], teacher_samples=[], committed_index=0, retained=True)


def teacher_turns(record: dict[str, Any]) -> int:
    """Teacher samples one episode cost: its assistant turns (one n=1 request each)."""
    return sum(1 for m in record.get("messages") or [] if m.get("role") == "assistant")


def rounds_of(starts: Sequence[Task]) -> list[list[Task]]:
    """The starts split into rounds of distinct tasks (a task started twice in a step gets its
    own episodes: the episode files key episodes by task and trial)."""
    rounds: list[list[Task]] = []
    for task in starts:
        for r in rounds:
            if all(t.task_id != task.task_id or t.env != task.env for t in r):
                r.append(task)
                break
        else:
            rounds.append([task])
    return rounds


class FreshKDSource:
    """`train.sources.GroupSource`: each `collect(step)` runs the teacher afresh (module
    docstring). `make_agent()` builds the teacher agent (called once per step: an async HTTP
    client belongs to one event loop); `stream` is the run's task stream (`next_step()`)."""

    def __init__(self, make_agent: Callable[[], Any], stream: Any, make_env: Any, tokenizer: Any, *,
                 out_dir: str | Path, trials: int = 4, min_reward: float = 1.0, max_prompt_tokens: int,
                 enable_thinking: bool = False, concurrency: int = 8, max_actions: int = 200,
                 process_index: int = 0, process_count: int = 1, max_outage_steps: int = 2, owns_env: bool = False):
        """`owns_env`: close() ends make_env's pools (the builder hands its factory over)."""
        if trials < 1:
            raise ValueError(f"kd.trials must be >= 1 (fresh teacher episodes per task start), got {trials}")
        self.make_agent, self.stream, self.make_env, self.tokenizer = make_agent, stream, make_env, tokenizer
        self.out_dir = Path(out_dir)
        self._own_env = make_env if owns_env else None
        self.trials, self.min_reward = int(trials), float(min_reward)
        self.max_prompt_tokens, self.enable_thinking = int(max_prompt_tokens), bool(enable_thinking)
        self.concurrency, self.max_actions = int(concurrency), int(max_actions)
        self.process_index, self.process_count = process_index, process_count
        self.next_step = 0
        self.max_outage_steps = int(max_outage_steps)   # collect.max_outage_steps, as ActionOPD's collector
        self._outage_steps = 0   # consecutive steps in which the teacher finished no episode
        self.last_unavailable: list[str] = []
        self.teacher_samples = 0  # over the run, this process
        self.episodes = 0
        self._last: dict[str, float] = {}
        self.last_records: list[dict[str, Any]] = []

    def episodes_of(self, step: int, starts: Sequence[Task]) -> list[dict[str, Any]]:
        """Every fresh teacher episode of `step` (successful or not)."""
        records: list[dict[str, Any]] = []
        self.last_unavailable = []
        for r, tasks in enumerate(rounds_of(starts)):
            offset = (step * len(rounds_of(starts)) + r) * self.trials
            agent = SeededTrials(self.make_agent(), offset)
            path = self.out_dir / f"step-{step:05d}-p{self.process_index}-r{r}.jsonl"
            records += asyncio.run(teacher_trajectories(
                agent, tasks, self.make_env, trials=self.trials, concurrency=self.concurrency, keep_successful=False,
                max_actions=self.max_actions, out_jsonl=path, unavailable=self.last_unavailable))
        return records

    def collect(self, step: int, policy: Any = None) -> list[StateGroup]:
        starts = self.stream.next_step()[self.process_index::self.process_count]
        records = self.episodes_of(step, starts)
        kept = [r for r in records if is_successful(r, self.min_reward)]
        examples = kd_examples(kept, self.tokenizer, max_prompt_tokens=self.max_prompt_tokens,
                               enable_thinking=self.enable_thinking)
        samples = sum(teacher_turns(r) for r in records)
        self.teacher_samples += samples
        self.episodes += len(records)
        self.last_records = records
        self.next_step = step + 1
        self._watch_teacher(step, len(starts), len(records))
        self._last = {"kd/task_starts": float(len(starts)), "kd/episodes": float(len(records)),
                      "kd/episodes_unavailable": float(len(self.last_unavailable)),
                      "kd/episodes_kept": float(len(kept)), "kd/examples": float(len(examples)),
                      "kd/teacher_samples": float(samples),
                      "kd/target_tokens": float(sum(e.target_ids.size for e in examples))}
        log.info("KD step %d: %d task starts x %d fresh teacher episodes, %d successful -> %d examples",
                 step, len(starts), self.trials, len(kept), len(examples))
        return [example_group(e) for e in examples]

    def _watch_teacher(self, step: int, starts: int, finished: int) -> None:
        """Episodes the teacher (or a user endpoint) could not finish are said loudly with their
        endpoint and counts; a step in which none finished is an outage step, and after
        collect.max_outage_steps of them in a row the run stops, as ActionOPD's collector does
        (issue 46 item 5: a KD run whose teacher never answered exited 0 after "update skipped")."""
        from actionopd_jax.eval.runner import unavailable_summary
        from actionopd_jax.train.sources import RunStop

        lost = self.last_unavailable
        if not lost:
            self._outage_steps = 0
            return
        summary = unavailable_summary(lost) or f"{len(lost)} episode(s) not finished"
        detail = f"{summary}; last error: {lost[-1]}"
        if finished or not starts:
            self._outage_steps = 0
            log.error("KD step %d: %s (they rerun if the step is collected again)", step, detail)
            return
        self._outage_steps += 1
        limit = self.max_outage_steps
        log.error("KD step %d: no teacher episode finished: %s; the step trains nothing (%d such step(s) in a row%s)",
                  step, detail, self._outage_steps, f"; the run stops at {limit}" if limit else "")
        if limit and self._outage_steps >= limit:
            raise RunStop(f"KD: no teacher episode finished in {self._outage_steps} steps in a row (last: step "
                          f"{step}, {starts} task starts; {detail}): the endpoint is down, or teacher.base_url / "
                          "teacher.model / its API key are wrong. Fix it and rerun the command: the run resumes from "
                          "its last checkpoint (collect.max_outage_steps sets the patience)")

    def close(self) -> None:
        from actionopd_jax.envs.registry import close_env_factory

        close_env_factory(self._own_env)
        self._own_env = None

    def state_dict(self) -> dict[str, Any]:
        return {"next_step": self.next_step, "stream": self.stream.get_state(),
                "teacher_samples": self.teacher_samples, "episodes": self.episodes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_step = int(state.get("next_step", 0))
        if "stream" in state:
            self.stream.set_state(state["stream"])
        self.teacher_samples = int(state.get("teacher_samples", 0))
        self.episodes = int(state.get("episodes", 0))

    def metrics(self) -> dict[str, float]:
        return dict(self._last)
