"""Self-ActionOPD's privileged teacher input (paper B.5), per task; never shown to the student
or the matcher.

- An explicit `payload["privileged_context"]` is used as it is.
- BFCL: the reference calls of every user turn (BFCL's user requests are public; the private
  part is the solution).
- tau2: everything paper B.5 gives the teacher about the task's targets. A PREPARED SUMMARY
  of the user's private goals, constraints, preferences and known/unknown information (paper:
  written offline and reviewed), read from the summaries file that
  `teacher.privileged_summaries` names, never the simulator's raw instructions; then, from the
  evaluation criteria: the reference tool names and arguments, the customer-side operations
  (the user's own device operations, written as a user-facing instruction in words, not as
  user-tool syntax), the target states the run is checked against (`env_assertions`: the
  user's device and the back-end records at the end), and the required messages and outcomes
  (`communicate_info`, the information the user must be told; `nl_assertions`, what the agent
  must say or do). Issue 43 item 7: the target states and the outcome assertions were left
  out, and device operations were shown as tool syntax.

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


def _words(name: str) -> str:
    """A tool or check name as words ("toggle_airplane_mode" -> "toggle airplane mode")."""
    return name.replace("_", " ").strip()


def _arguments_in_words(arguments: Mapping) -> str:
    """Arguments as "key: value" words ("app name: messaging, permission: sms"), no JSON."""
    def value(v) -> str:
        return ("on" if v else "off") if isinstance(v, bool) else str(v).replace("_", " ")

    return ", ".join(f"{_words(str(k))}: {value(v)}" for k, v in sorted(arguments.items()))


def device_instruction(name: str, arguments: Mapping) -> str:
    """A customer-side operation as the user-facing instruction the agent gives (paper B.5: not
    user-tool syntax; the words add no fact beyond the operation and its arguments)."""
    args = _arguments_in_words(arguments)
    return f"ask the user to {_words(name)} on their phone" + (f" ({args})" if args else "")


def target_state(assertion) -> str:
    """One `env_assertions` entry as a target state in words: whose state, what must hold."""
    owner = "the user's phone" if getattr(assertion, "env_type", "") == "user" else "the back-end records"
    what = _words(assertion.func_name.removeprefix("assert_"))
    args = _arguments_in_words(getattr(assertion, "arguments", None) or {})
    holds = "must hold" if getattr(assertion, "assert_value", True) else "must NOT hold"
    return f"{owner}: {what}" + (f" ({args})" if args else "") + f" {holds}"


def _tau2_context(task: Task, summary: str) -> str:
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
            if a.requestor == "user":  # a customer-side device operation: what the agent asks the user to do
                lines.append(f"- {device_instruction(a.name, a.arguments or {})}")
            else:
                lines.append(f"- {a.name}({json.dumps(a.arguments, sort_keys=True)})")
    states = list(getattr(criteria, "env_assertions", None) or [])
    if states:
        lines.append("Target states (checked when the conversation ends):")
        lines += [f"- {target_state(x)}" for x in states]
    info = list(getattr(criteria, "communicate_info", None) or [])
    if info:
        lines.append("Information the user must be told: " + "; ".join(str(x) for x in info))
    outcomes = list(getattr(criteria, "nl_assertions", None) or [])
    if outcomes:
        lines.append("Required messages and outcomes:")
        lines += [f"- {x}" for x in outcomes]
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
