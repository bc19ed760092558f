"""Self-ActionOPD's privileged teacher input (paper B.5), per task; never shown to the student
or the matcher.

- An explicit `payload["privileged_context"]` is used as it is.
- BFCL: the reference calls of every user turn (BFCL's user requests are public; the private
  part is the solution).
- tau2: a PREPARED SUMMARY of the user's private goals, constraints, preferences and
  known/unknown information (paper: written offline and reviewed), read from the summaries
  file that `teacher.privileged_summaries` names, never the simulator's raw instructions; then,
  from the evaluation criteria, the reference actions (the user's own device operations
  written as the instruction the agent gives, not as user-tool syntax) and the information the
  user must be told.

The summaries file (docs/formats.md, "Privileged summaries"; read by `summary_file.py`): JSON
lines, one object per task, `{"task_id": "<domain>/<tau2 id>", "summary": "<text>"}`, the task
id as `actionopd` names tau2 tasks (e.g. "airline/0"). Drafts that `actionopd tau2 summaries`
wrote carry `"reviewed": false` and are never used: training on a task whose only summary is
an unreviewed draft is refused (`check_self_teacher`), so a human reads every summary first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from actionopd_jax.baselines.summary_file import read_summary_file
from actionopd_jax.types import Task


def load_summaries(path: str | Path) -> dict[str, str]:
    """task id -> REVIEWED summary, from a summaries file (module docstring); unreviewed drafts
    and error lines are left out; a bad file is refused with the line and what is wrong."""
    return read_summary_file(path).reviewed


def needs_summary(task: Task) -> bool:
    explicit = task.payload.get("privileged_context")
    return task.env.startswith("tau2_") and not (isinstance(explicit, str) and explicit)


def missing_summaries(tasks: list[Task], summaries: Mapping[str, str]) -> list[str]:
    """Task ids that need a prepared summary and have none."""
    return [t.task_id for t in tasks if needs_summary(t) and t.task_id not in summaries]


def _bfcl_context(task: Task) -> str:
    from actionopd_jax.envs import bfcl_data

    turns = bfcl_data.ground_truth(task.task_id)
    lines = ["Reference tool calls for each user turn (in order):"]
    for i, calls in enumerate(turns, 1):
        lines.append(f"Turn {i}: " + ("; ".join(calls) if calls else "no call; the request cannot be completed with the tools"))
    return "\n".join(lines)


def _tau2_context(task: Task, summary: str) -> str:
    from actionopd_jax.envs.reference import user_action_request
    from actionopd_jax.envs.tau2_tasks import tau2_task

    domain, tau2_id = task.payload.get("domain"), task.payload.get("tau2_id")
    if domain is None or tau2_id is None:
        domain, tau2_id = task.task_id.split("/", 1)
    criteria = getattr(tau2_task(domain, tau2_id), "evaluation_criteria", None)
    lines = ["Summary of the user's private goals, constraints, preferences and what they know and do not know:",
             summary]
    actions = list(getattr(criteria, "actions", None) or [])
    if actions:
        lines.append("Reference actions (in order):")
        for a in actions:
            if a.requestor == "user":  # a device operation: what the agent asks the user to do
                lines.append(f"- ask the user: {user_action_request(a.name, a.arguments)}")
            else:
                lines.append(f"- {a.name}({json.dumps(a.arguments, sort_keys=True)})")
    info = list(getattr(criteria, "communicate_info", None) or [])
    if info:
        lines.append("Information the user must be told: " + "; ".join(str(x) for x in info))
    return "\n".join(lines)


def privileged_context(task: Task, summaries: Mapping[str, str] | None = None) -> str:
    """The task's teacher-only information ('' when there is none); a tau2 task without a
    prepared summary is refused (the simulator's raw instructions are never used)."""
    explicit = task.payload.get("privileged_context")
    if isinstance(explicit, str) and explicit:
        return explicit
    if task.env == "bfcl":
        return _bfcl_context(task)
    if task.env.startswith("tau2_"):
        summary = (summaries or {}).get(task.task_id)
        if not summary:
            raise ValueError(f"Self-ActionOPD: tau2 task {task.task_id!r} has no prepared privileged summary; add "
                             "it to the file teacher.privileged_summaries names (docs/formats.md)")
        return _tau2_context(task, summary)
    return ""
