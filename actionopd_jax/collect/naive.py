"""The sequential baseline: one trajectory at a time, and at each state the teacher, then
the student, then the matcher, each waiting for the previous one (no overlap, one state per
device call). It shares every rule with the async collector -- prompt budget, keys, parsing,
group building, commit -- so both produce the same groups; only the schedule differs. Used
by benchmarks/collector.py to show what the async schedule buys.
"""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

import numpy as np

import actionopd_jax.collect.keys as keys
from actionopd_jax.collect.collector import Collector, CollectResult
from actionopd_jax.collect.env_calls import safe_score
from actionopd_jax.collect.group import NO_COMMIT
from actionopd_jax.collect.metrics import StepMetrics, TrajectoryRecord
from actionopd_jax.types import StateGroup, Task


async def collect_sequential(collector: Collector, starts: Sequence[tuple[int, Task]], *, step: int) -> CollectResult:
    cfg = collector.cfg
    metrics = StepMetrics()
    records: list[TrajectoryRecord] = []
    outcomes: list[tuple[int, StateGroup, np.ndarray | None]] = []
    t0 = time.perf_counter()
    for start, task in starts:
        rec = TrajectoryRecord(task_start=start, task_id=task.task_id, env=task.env)
        env = collector.env_factory(task)
        obs = await env.reset(task)
        limit = cfg.decision_limit(task.env)
        while True:
            prompt = collector.next_prompt(obs, env, limit, rec)
            if prompt is None:
                break
            decision = rec.decisions
            rec.decisions += 1
            batch, failure = await collector._teacher_samples(task, prompt, rec)
            if failure or not batch.samples:
                rec.end_reason = failure or ("teacher_error" if batch.unanswered else "no_supervision")   # as the collector
                env.end(rec.end_reason)
                break
            t_s = time.perf_counter()
            generations = collector.sample_fn([prompt.ids], [keys.student_key(cfg.seed, step, start, decision)])[0]
            busy = time.perf_counter() - t_s
            metrics.sampler_busy_s += busy
            metrics.sampler_calls += 1
            metrics.sampler_states += 1
            rec.sampler_wait_s += busy
            outcome = await collector.group_outcome(task, start, step, decision, prompt, generations, batch, rec, env=env)
            if outcome.group is not None:
                outcomes.append((start, outcome.group, outcome.score.counts))
                rec.groups += 1
            if outcome.committed == NO_COMMIT:
                rec.end_reason = outcome.drop_reason
                env.end(rec.end_reason)
                break
            t_e = time.perf_counter()
            obs, _ = await env.step(outcome.group.candidates[outcome.committed].action)
            rec.env_s += time.perf_counter() - t_e
        rec.score = safe_score(env, rec.end_reason)
        records.append(rec)
    metrics.wall_s = time.perf_counter() - t0
    return CollectResult.assemble(step, outcomes, records, metrics)


def run_sequential(collector: Collector, tasks: Sequence[Task], *, step: int) -> CollectResult:
    return asyncio.run(collect_sequential(collector, list(enumerate(tasks)), step=step))
