"""The async state-group collector (paper section 2.3, algorithm 1, appendix A.4).

Many trajectories run at once on one asyncio loop. At each state of a trajectory:

1. the prompt is built within the context budget (the trajectory ends cleanly when the
   protected part cannot fit);
2. the K teacher samples are requested (async, cached) and, at the same moment, the state is
   queued for the student; the sampler worker puts every ready state into one device call;
3. when the teacher multiset is empty there is no group and the trajectory ends (no failure
   label); otherwise the N candidates are parsed with the student rules and matched against
   every teacher sample (rules, then the LLM judge, async); "unavailable" masks, never ends (A.3);
4. rewards r_lambda, retention and the commit (highest semantic reward, seeded uniform
   tie-break) come from group.py; the committed action steps the environment.

One behaviour snapshot of the student serves the whole collection (the caller updates the
model only after `collect` returns); teacher samples and verdicts are fixed in the returned
groups before any update. Every random choice uses a key derived from (seed, step, task
start, decision), never from arrival order, and the groups come back sorted by (task start,
decision), so reruns with a warm teacher cache reproduce the same groups.

Multi-host: each process collects its own share of the task starts (`local_task_starts`)
with its own sampler on its local devices; nothing here is a cross-host collective.

This module is the schedule; the calls into environments (deadlines, end reasons, scoring)
are in env_calls.py and the requests to the teacher and matcher (and their usage) in
supervision.py, both shared with the sequential baseline (naive.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

import actionopd_jax.collect.keys as keys  # the module itself: collect/__init__ imports this one
from actionopd_jax.paid_calls import BudgetReached
from actionopd_jax.collect.config import CollectorConfig
from actionopd_jax.collect.group import NO_COMMIT, GroupOutcome, build_group
from actionopd_jax.collect.metrics import StepMetrics, TrajectoryRecord
from actionopd_jax.chat.prompt import CandidateDecoder, FitFn, Prompt, PromptBuilder
from actionopd_jax.collect.engine_worker import EngineSampling, EngineWorker
from actionopd_jax.collect.env_calls import EnvFailure, env_call, prefetch, safe_end, safe_score
from actionopd_jax.collect.sampler_worker import SampleFn, SamplerError, SamplerWorker
from actionopd_jax.collect.supervision import record_usage, teacher_samples, usage_snapshot, verdicts
from actionopd_jax.envs.base import Environment
from actionopd_jax.envs.evidence import evidence_scope
from actionopd_jax.envs.protocol import apply_protocol_rules
from actionopd_jax.envs.registry import EnvFactory, default_env_factory  # noqa: F401  (re-exported)
from actionopd_jax.teacher.base import TeacherBatch
from actionopd_jax.types import Candidate, Observation, StateGroup, Task

log = logging.getLogger(__name__)


@dataclass
class CollectResult:
    step: int
    groups: list[StateGroup]               # sorted by (task start, decision index)
    group_starts: list[int]                # the global task start of each group (parallel list)
    trajectories: list[TrajectoryRecord]   # sorted by task start
    metrics: StepMetrics

    @property
    def retained_groups(self) -> list[StateGroup]:
        return [g for g in self.groups if g.retained]

    @classmethod
    def assemble(cls, step: int, outcomes: Sequence[tuple[int, StateGroup, np.ndarray | None]],
                 records: list[TrajectoryRecord], metrics: StepMetrics) -> "CollectResult":
        """The step's result from its (task start, group, counts) outcomes and trajectory
        records, already in order; adds them to `metrics`. Shared with the sequential baseline
        so both report groups and metrics the same way."""
        for _, group, counts in outcomes:
            metrics.add_group(group, counts)
        for rec in records:
            metrics.add_trajectory(rec)
        return cls(step=step, groups=[o[1] for o in outcomes], group_starts=[o[0] for o in outcomes],
                   trajectories=records, metrics=metrics)


async def aclose_clients(*owners) -> None:
    """`await owner.aclose()` for each owner that has one (teacher, matcher); a failure to
    close is logged, never raised: the step's results are already safe."""
    for owner in owners:
        aclose = getattr(owner, "aclose", None)
        if aclose is None:
            continue
        try:
            await aclose()
        except Exception as e:  # noqa: BLE001 - shutting down: say it, go on
            log.warning("closing %s's HTTP client failed: %s: %s", type(owner).__name__, type(e).__name__, e)


def local_task_starts(num_starts: int, process_index: int, process_count: int) -> list[int]:
    """The global task-start indices this process collects: every process_count-th one,
    beginning at process_index (balanced to within one start, stable under resumption)."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} must lie in [0, process_count={process_count})")
    return list(range(process_index, num_starts, process_count))


@dataclass
class _Decision:
    outcome: GroupOutcome | None
    end_reason: str = ""   # set when the trajectory must end at this state
    candidates_ready: bool = False


class Collector:
    """Collects the state groups of one training step.

    teacher: a `Teacher` (usually a `CachedTeacher`); matcher: an object with
    `async match_group(candidate_actions, teacher_actions, *, messages, tools, env)` (a
    `matching.Matcher`); sample_fn: see `sampler_worker.sampler_fn` (wraps a `Sampler`), or an
    `engine_worker.EngineSampling` (the continuous-batching engine, one state at a time);
    eos_ids: end-of-turn ids stripped before decoding; env_factory: a fresh environment per
    task start; context_fit: the context-budget policy (see prompt.PromptBuilder);
    judged_log: a `matching.judged_log.JudgedLog` that records every state's verdicts, or None.
    """

    def __init__(self, cfg: CollectorConfig, *, tokenizer: Any, teacher: Any, matcher: Any, sample_fn: SampleFn,
                 eos_ids: Sequence[int], env_factory: EnvFactory | None = None, context_fit: FitFn | None = None,
                 judged_log: Any = None):
        self.cfg = cfg
        self.judged_log = judged_log  # matching.judged_log.JudgedLog: every judged pair, for audit-matcher
        self.teacher = teacher
        self.last_teacher_error = ""   # the last state the teacher never answered: its error class and message
        self.matcher = matcher
        self.sample_fn = sample_fn
        self.env_factory = env_factory or default_env_factory()
        self.prompts = PromptBuilder(tokenizer, max_prompt_tokens=cfg.max_prompt_tokens,
                                     enable_thinking=cfg.enable_thinking, fit=context_fit)
        self.decoder = CandidateDecoder(tokenizer, eos_ids=list(eos_ids), truncated_is_invalid=cfg.truncated_is_invalid)
        # One event loop for every step: HTTP clients and their pools are bound to a loop, so
        # reusing it keeps connections alive across steps instead of rebuilding them.
        self._loop: asyncio.AbstractEventLoop | None = None

    def close(self) -> None:
        """Close the teacher's and the judge's HTTP clients on the collector's event loop, then
        the loop. (Closed with the loop instead, the clients' own clean-up later found the loop
        closed: "Event loop is closed" on stderr.)"""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.run_until_complete(aclose_clients(self.teacher, self.matcher))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()
        self._loop = None
        if self.judged_log is not None:
            self.judged_log.close()

    def __enter__(self) -> "Collector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- public entry points -----------------------------------------------------------------

    def collect(self, tasks: Sequence[Task], *, step: int, process_index: int | None = None,
                process_count: int | None = None) -> CollectResult:
        """Collect this process's share of `tasks` (the step's global list of task starts).
        Process index/count default to jax's (multi-host: each process passes the same list)."""
        if process_index is None or process_count is None:
            import jax

            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        starts = [(i, tasks[i]) for i in local_task_starts(len(tasks), process_index, process_count)]
        show = self.cfg.progress and process_index == 0
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self.collect_async(starts, step=step, progress=show))

    async def collect_async(self, starts: Sequence[tuple[int, Task]], *, step: int,
                            progress: bool | None = None) -> CollectResult:
        """Collect the given (global task-start index, task) pairs on the running loop."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        metrics = StepMetrics()
        usage_before = usage_snapshot(self.teacher, self.matcher)
        pending = list(starts)
        pending.reverse()  # pop() from the end = in order
        records: list[TrajectoryRecord] = []
        outcomes: list[tuple[int, StateGroup, np.ndarray | None]] = []
        bar = self._progress_bar(len(pending), progress)
        t0 = time.perf_counter()
        self.prefetch([task for _, task in starts])
        if isinstance(self.sample_fn, EngineSampling):   # collect.sampler = "engine"
            worker_cm = EngineWorker(self.sample_fn)
        else:
            worker_cm = SamplerWorker(self.sample_fn, max_states_per_call=self.cfg.max_states_per_call,
                                      max_queued=self.cfg.max_trajectories_in_flight,
                                      coalesce_s=self.cfg.sampler_coalesce_s, max_wait_s=self.cfg.sampler_max_wait_s)
        async with worker_cm as worker:

            async def run_one_at_a_time() -> None:
                # A fixed pool of runners pulling task starts: memory stays flat in the
                # number of task starts, and at most max_trajectories_in_flight are live.
                while pending:
                    start, task = pending.pop()
                    rec, groups = await self._trajectory(start, task, step, worker)
                    records.append(rec)
                    outcomes.extend((start, g, c) for g, c in groups)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(groups=len(outcomes), refresh=False)

            runners = [asyncio.create_task(run_one_at_a_time())
                       for _ in range(min(self.cfg.max_trajectories_in_flight, max(len(pending), 1)))]
            try:
                await asyncio.gather(*runners)
            except BudgetReached:
                # run.budget_*: the requests in flight are paid for; let them finish, so their
                # answers reach the teacher cache (each runner stops at its next reservation)
                await asyncio.gather(*runners, return_exceptions=True)
                raise
            except BaseException:
                for r in runners:
                    r.cancel()
                await asyncio.gather(*runners, return_exceptions=True)
                raise
            finally:
                if bar is not None:
                    bar.close()
        metrics.wall_s = time.perf_counter() - t0
        metrics.sampler_calls = worker.stats.calls
        metrics.sampler_states = worker.stats.states
        metrics.sampler_busy_s = worker.stats.busy_s
        record_usage(metrics, usage_before, usage_snapshot(self.teacher, self.matcher))
        outcomes.sort(key=lambda o: (o[0], o[1].decision_index))
        records.sort(key=lambda r: r.task_start)
        return CollectResult.assemble(step, outcomes, records, metrics)

    def prefetch(self, tasks: Sequence[Task]) -> None:
        """Have the environments start the servers of these task starts now, in the background
        (pools that have servers: AWM), so that an episode's reset, and the device step that
        waits on its states, does not wait for a cold server start. Returns at once."""
        prefetch(self.env_factory, tasks)

    # --- one trajectory ------------------------------------------------------------------------

    async def _trajectory(self, start: int, task: Task, step: int, worker: SamplerWorker
                          ) -> tuple[TrajectoryRecord, list[tuple[StateGroup, np.ndarray | None]]]:
        rec = TrajectoryRecord(task_start=start, task_id=task.task_id, env=task.env)
        groups: list[tuple[StateGroup, np.ndarray | None]] = []
        env: Environment | None = None
        try:
            env = self.env_factory(task)
            obs = await self._env_call(env.reset(task), rec)
            limit = self.cfg.decision_limit(task.env)
            while True:
                prompt = self.next_prompt(obs, env, limit, rec)
                if prompt is None:
                    break
                decision = await self._decide(task, start, step, rec.decisions, prompt, worker, rec, env=env)
                rec.decisions += 1
                outcome = decision.outcome
                if outcome is not None and outcome.group is not None:
                    groups.append((outcome.group, outcome.score.counts))
                    rec.groups += 1
                if decision.end_reason:
                    rec.end_reason = decision.end_reason
                    env.end(decision.end_reason)
                    break
                action = outcome.group.candidates[outcome.committed].action
                obs = await self._env_call(env.step(action), rec)
        except SamplerError:
            raise  # the device call failed: a systemic error, not one trajectory's problem
        except EnvFailure as err:
            rec.end_reason = err.reason
            log.warning("task start %d (%s): %s", start, task.task_id, err)
            safe_end(env, err.reason)
        except Exception as err:  # noqa: BLE001 - one broken trajectory must not sink the step
            rec.end_reason = f"error:{type(err).__name__}"
            log.exception("task start %d (%s) failed", start, task.task_id)
            safe_end(env, rec.end_reason)
        if env is not None:
            # off the loop: a verifier may run a sandboxed process or ask a judge (AWM)
            rec.score = await asyncio.to_thread(safe_score, env, rec.end_reason)
        return rec, groups

    def next_prompt(self, obs: Observation, env: Environment, limit: int | None,
                    rec: TrajectoryRecord) -> Prompt | None:
        """The prompt of the trajectory's next decision, or None when it ends here (then
        `rec.end_reason` says why and the environment has been told). One rule for when a
        trajectory stops, shared with the sequential baseline (naive.py)."""
        if obs.done:
            rec.end_reason = "env_done"
            return None
        if limit is not None and rec.decisions >= limit:
            rec.end_reason = "decision_limit"
        else:
            prompt = self.prompts.build(obs.messages, obs.tools)
            if prompt is not None:
                return prompt
            rec.end_reason = "context_overflow"
        env.end(rec.end_reason)
        return None

    async def _env_call(self, coro, rec: TrajectoryRecord) -> Observation:
        return await env_call(coro, self.cfg.env_timeout_s, rec)

    # --- one decision point ----------------------------------------------------------------------

    async def _decide(self, task: Task, start: int, step: int, decision: int, prompt: Prompt,
                      worker: SamplerWorker, rec: TrajectoryRecord, env: Any = None) -> _Decision:
        cfg = self.cfg
        t_state = time.perf_counter()
        student_key = keys.student_key(cfg.seed, step, start, decision)
        teacher_call = asyncio.create_task(self._teacher_samples(task, prompt, rec))
        student_call = asyncio.create_task(self._student_samples(worker, prompt, student_key, rec))
        try:
            batch, failure = await teacher_call
            if failure or not batch.samples:
                student_call.cancel()  # withdraw the state if the worker has not taken it yet
                await asyncio.gather(student_call, return_exceptions=True)
                # an unanswered state is an outage (source._watch_teacher counts them), not invalid replies
                reason = failure or ("teacher_error" if batch.unanswered else "no_supervision")
                return _Decision(outcome=None, end_reason=reason)
            generations = await student_call
        except BaseException:
            teacher_call.cancel()
            student_call.cancel()
            raise
        outcome = await self.group_outcome(task, start, step, decision, prompt, generations, batch, rec, env=env)
        rec.state_s += time.perf_counter() - t_state
        end = outcome.drop_reason if outcome.committed == NO_COMMIT else ""
        return _Decision(outcome=outcome, end_reason=end)

    async def group_outcome(self, task: Task, start: int, step: int, decision: int, prompt: Prompt,
                            generations: Sequence[Any], batch: TeacherBatch, rec: TrajectoryRecord,
                            env: Any = None) -> GroupOutcome:
        """Parse the student's generations into candidates, match them against the teacher
        samples and build the group (rewards, retention, seeded commit). Shared with the
        sequential baseline so both schedules produce the same groups."""
        candidates = []
        for gen in generations:
            text = self.decoder.text(gen.token_ids)
            parsed = self.decoder.action(text, prompt.tools, gen.finish_reason)  # then tau2's transfer rule:
            action = apply_protocol_rules(task.env, parsed, prompt.messages)
            candidates.append(Candidate(token_ids=np.asarray(gen.token_ids, np.int32),
                                        logprobs=np.asarray(gen.logprobs, np.float32), text=text,
                                        action=action, finish_reason=gen.finish_reason))
        # the matcher's execution stage forks the live state (envs/fork.py) where the env can
        fork = getattr(env, "fork_point", None) if env is not None else None
        found = await verdicts(self.matcher, candidates, batch, prompt, rec, evidence_scope(task),
                               timeout_s=self.cfg.matcher_timeout_s, fork=fork)
        if self.judged_log is not None:
            self.judged_log.record(step=step, task_start=start, task_id=task.task_id, env=task.env, decision=decision,
                                   messages=prompt.messages, tools=prompt.tools,
                                   candidates=[c.action for c in candidates],
                                   teacher=[s.action for s in batch.samples], verdicts=found,
                                   matcher=self.matcher, evidence_env=evidence_scope(task))
        cfg = self.cfg
        return build_group(task_id=task.task_id, decision_index=decision, prompt_ids=prompt.ids,
                           candidates=candidates, teacher_samples=batch.samples, verdicts=found,
                           reward_cfg=cfg.reward, commit_mode=cfg.commit,
                           key=keys.commit_key(cfg.seed, step, start, decision))

    async def _teacher_samples(self, task: Task, prompt: Prompt, rec: TrajectoryRecord
                               ) -> tuple[TeacherBatch, str]:
        batch, failure, error = await teacher_samples(self.teacher, task, prompt, k=self.cfg.k,
                                                      timeout_s=self.cfg.teacher_timeout_s, rec=rec)
        if error is not None:
            self.last_teacher_error = error
        return batch, failure

    async def _student_samples(self, worker: SamplerWorker, prompt: Prompt, key, rec: TrajectoryRecord):
        t0 = time.perf_counter()
        try:
            return await worker.sample(prompt.ids, key, session=rec.task_start)
        finally:
            rec.sampler_wait_s += time.perf_counter() - t0

    # --- bookkeeping -----------------------------------------------------------------------------

    @staticmethod
    def _progress_bar(total: int, enabled: bool | None):
        if not enabled:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="collect", unit="traj", dynamic_ncols=True, leave=False)

