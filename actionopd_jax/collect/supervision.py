"""A state's requests to the supervising services, and what those services cost a step.

The teacher's K samples and the matcher's verdicts are each awaited under their own deadline
(`collect.teacher_timeout_s`, `collect.matcher_timeout_s`), and neither raises out of here: a
teacher that does not answer becomes a named failure ("teacher_timeout" / "teacher_error": no
group, the trajectory ends), a matcher that fails masks the group ("unavailable", appendix
A.3). The usage snapshots (teacher, matcher stages, its LLM judge, the user simulators) are
taken before and after a step; their difference is the step's cost in the metrics.

This is the collector's whole contact with the paid services, kept apart from the schedule
(collector.py) so both schedules -- the async collector and the sequential baseline
(naive.py) -- ask and account for them the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from actionopd_jax.chat.prompt import Prompt
from actionopd_jax.collect.metrics import StepMetrics, TrajectoryRecord
from actionopd_jax.envs import user_sim
from actionopd_jax.teacher.base import TeacherBatch, UsageReport
from actionopd_jax.types import Candidate, Task, Verdict

log = logging.getLogger("actionopd_jax.collect.collector")   # the collector's log, as before the split


async def teacher_samples(teacher: Any, task: Task, prompt: Prompt, *, k: int, timeout_s: float,
                          rec: TrajectoryRecord) -> tuple[TeacherBatch, str, str | None]:
    """(batch, failure, error) for one state: failure is "" when the teacher answered (the
    batch may still hold no valid sample), else "teacher_timeout" / "teacher_error" with an
    empty batch; error is the error class and message for the outage report (source.py), or
    None when nothing new failed. Adds the latency to `rec.teacher_s`."""
    t0 = time.perf_counter()
    try:
        batch = await asyncio.wait_for(
            teacher.sample_detailed(prompt.messages, prompt.tools, k, key_info={"task_id": task.task_id, "env": task.env}),
            timeout_s)
        if batch.unanswered:   # every slot lost past the transport retries: say so, with what failed
            log.warning("%s answered none of %d sample(s) on %s: %s", teacher_where(teacher),
                        batch.requested, task.task_id, batch.transport_error)
            return batch, "", batch.transport_error
        return batch, "", None
    except asyncio.TimeoutError:
        log.warning("%s timed out after %ss on %s", teacher_where(teacher), timeout_s, task.task_id)
        return (TeacherBatch(samples=[], requested=k), "teacher_timeout",
                f"TimeoutError: no answer in collect.teacher_timeout_s={timeout_s}s")
    except Exception as err:  # noqa: BLE001 - e.g. a permanent 4xx: no supervision here
        log.warning("%s failed on %s: %s: %s", teacher_where(teacher), task.task_id, type(err).__name__, err)
        return TeacherBatch(samples=[], requested=k), "teacher_error", f"{type(err).__name__}: {err}"
    finally:
        rec.teacher_s += time.perf_counter() - t0


async def verdicts(matcher: Any, candidates: list[Candidate], batch: TeacherBatch, prompt: Prompt,
                   rec: TrajectoryRecord, env: str, *, timeout_s: float, fork: Any = None) -> list[list[Verdict]]:
    """The matcher's verdict of every (candidate, teacher sample) pair; all "unavailable" when
    it fails or passes `timeout_s`. Adds the latency to `rec.matcher_s`."""
    t0 = time.perf_counter()
    extra = {"fork": fork} if fork is not None else {}  # matchers without an execution stage take none
    try:
        return await asyncio.wait_for(
            matcher.match_group([c.action for c in candidates], [s.action for s in batch.samples],
                                messages=prompt.messages, tools=prompt.tools, env=env, **extra),
            timeout_s)
    except asyncio.TimeoutError:
        log.warning("matcher timed out after %ss: group masked", timeout_s)
    except Exception as err:  # noqa: BLE001 - a matcher failure is unavailable supervision
        log.warning("matcher failed (%s: %s): group masked", type(err).__name__, err)
    finally:
        rec.matcher_s += time.perf_counter() - t0
    return [["unavailable"] * len(batch.samples) for _ in candidates]


def teacher_where(teacher: Any) -> str:
    """"teacher endpoint URL (model M)" of a teacher client (through its cache wrapper), for the
    outage messages; the teacher's class name where it has no endpoint."""
    t = teacher
    while t is not None:
        cfg = getattr(t, "cfg", None)
        if getattr(cfg, "base_url", None):
            return f"teacher endpoint {cfg.base_url} (model {getattr(cfg, 'model', '?')})"
        t = getattr(t, "inner", None)
    return f"teacher {type(teacher).__name__}"


@dataclass
class Usage:
    """One snapshot of the services' running counters (copies: providers update theirs in place)."""
    teacher: UsageReport = field(default_factory=UsageReport)
    matcher: dict[str, int] = field(default_factory=dict)
    judge: UsageReport = field(default_factory=UsageReport)   # the matcher's LLM judge (its requests and tokens)
    user: UsageReport = field(default_factory=UsageReport)    # the user simulators (envs/user_sim.USAGE)


def usage_snapshot(teacher: Any, matcher: Any) -> Usage:
    report = getattr(teacher, "usage", None)
    stats = getattr(matcher, "stats", None)
    counts = stats.as_dict() if hasattr(stats, "as_dict") else {}
    judge = getattr(getattr(matcher, "judge", None), "usage", None)
    snapshot = UsageReport(**report.as_dict()) if isinstance(report, UsageReport) else UsageReport()
    judged = UsageReport(**judge.as_dict()) if isinstance(judge, UsageReport) else UsageReport()
    judged.cache_hits = int(counts.get("judge_reused", 0))   # pairs the judge was not asked again
    users = UsageReport(**user_sim.USAGE.snapshot())
    return Usage(teacher=snapshot, matcher=dict(counts), judge=judged, user=users)


def record_usage(metrics: StepMetrics, before: Usage, after: Usage) -> None:
    """Put what the services did between the two snapshots into the step's metrics."""
    metrics.teacher = _usage_delta(before.teacher, after.teacher)
    metrics.matcher = {k: v - before.matcher.get(k, 0) for k, v in after.matcher.items()}
    metrics.judge = _usage_delta(before.judge, after.judge)
    metrics.user = _usage_delta(before.user, after.user)


def _usage_delta(before: UsageReport, after: UsageReport) -> UsageReport:
    return UsageReport(**{k: v - getattr(before, k) for k, v in after.as_dict().items()})
