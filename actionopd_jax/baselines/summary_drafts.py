"""Drafting Self-ActionOPD's privileged summaries (paper B.5) with an LLM, one tau2 task at a
time, into the summaries file the recipe reads (`summary_file.py`). `actionopd tau2 summaries`
is the command over it.

What the drafter is shown, per task (B.5: "private goals, constraints, preferences, and
known/unknown information", plus the evaluation criteria):
- the user simulator's private instructions: persona, reason for the call, what the user
  knows and does not know, how they behave;
- the evaluation criteria: reference actions, required messages, natural-language assertions
  (so the summary keeps the facts that matter; the teacher gets the actions and messages
  themselves separately, so the summary must not restate them).
Left out: the task's initial state (hidden simulator state such as which device settings are
broken), the benchmark author's description of what the task tests, and the task id (tau2's
telecom ids spell out the broken settings).

A reply is checked before it is kept (`summary_problem`): empty, cut at max_tokens, a tool call,
JSON or code, too short or long, or a verbatim copy of an instruction line is retried; after
the last attempt the task gets an error line, never a summary. Every kept draft says
`"reviewed": false`: training refuses it until a human has read it and flipped the flag.

Paid calls are never repeated: tasks with a summary line in the output are skipped, and each
line is appended, flushed and fsynced as its reply arrives, so a kill loses at most the tasks
in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

from actionopd_jax.baselines.summary_file import SummaryFile, parse_line, sort_lines
from actionopd_jax.teacher.endpoint import EndpointSettings
from actionopd_jax.teacher.transport import PermanentRequestError, TransportGaveUp
from actionopd_jax.types import Task

MIN_SUMMARY_CHARS = 40
MAX_SUMMARY_CHARS = 2400  # ~600 tokens: the teacher's extra 4,096 also hold actions and messages
COPY_MIN_CHARS = 60       # an instruction line this long found whole in a summary is a copy

INSTRUCTIONS = (
    "You prepare private notes for a supervisor who coaches a customer-service agent. Below is "
    "what a simulated customer privately knows and wants, and what the conversation is judged "
    "on. Write a short summary of the customer's situation in the third person (\"The user is "
    "...\"): their goals, constraints and preferences, what they know (names, ids, details "
    "they can give) and what they do not know, and facts they reveal only later or only when "
    "asked. Keep every concrete name, id, number and condition exactly. Write 2 to 6 sentences "
    "of plain prose: no lists, headings, JSON or markup. Paraphrase; do not copy the "
    "instructions word for word, and do not address the customer as 'you'. Do not name the "
    "agent's tool calls or say what the agent should do or how the conversation is scored: the "
    "supervisor receives the reference actions separately. Reply with the summary only.")


@dataclasses.dataclass(frozen=True)
class DraftEndpointSettings(EndpointSettings):
    """The drafting model's endpoint."""

    who: ClassVar[str] = "summary drafter"

    temperature: float | None = 0.2
    max_tokens: int | None = 4096
    max_concurrency: int = 4


# --- what the drafter reads ----------------------------------------------------------------------
def _tau2_record(task: Task):
    from actionopd_jax.envs.tau2_tasks import tau2_task

    domain, tau2_id = task.task_id.split("/", 1)
    return tau2_task(domain, tau2_id)


def private_texts(record: Any) -> list[str]:
    """The simulator's private instruction fields (what a summary must paraphrase, not copy)."""
    ins = record.user_scenario.instructions
    fields = [getattr(ins, k, None) for k in ("reason_for_call", "known_info", "unknown_info", "task_instructions")]
    return [str(f) for f in fields if f]


def source_material(record: Any) -> str:
    """A task's private goals and evaluation criteria as the drafter sees them (module docstring)."""
    scen, ins = record.user_scenario, record.user_scenario.instructions
    parts = []
    if scen.persona:
        parts.append(f"Persona:\n{str(scen.persona).strip()}")
    for label, key in (("Reason for the call", "reason_for_call"), ("What the customer knows", "known_info"),
                       ("What the customer does not know", "unknown_info"),
                       ("How the customer behaves", "task_instructions")):
        value = getattr(ins, key, None)
        if value:
            parts.append(f"{label}:\n{str(value).strip()}")
    crit = record.evaluation_criteria
    actions = list(getattr(crit, "actions", None) or [])
    if actions:
        parts.append("Reference actions (context only):\n" + "\n".join(
            f"- {a.requestor} {a.name}({json.dumps(a.arguments, sort_keys=True)})" for a in actions))
    info = list(getattr(crit, "communicate_info", None) or [])
    if info:
        parts.append("The customer must be told (context only): " + "; ".join(str(x) for x in info))
    asserts = list(getattr(crit, "nl_assertions", None) or [])
    if asserts:
        parts.append("The conversation is judged on (context only):\n" + "\n".join(f"- {a}" for a in asserts))
    return "\n\n".join(parts)


def draft_messages(task: Task, example: tuple[Task, str] | None) -> list[dict[str, str]]:
    """The chat request for one task; `example` is a reviewed (task, summary) of its domain."""
    messages = [{"role": "system", "content": INSTRUCTIONS}]
    if example is not None:
        ex_task, ex_summary = example
        messages.append({"role": "user", "content": source_material(_tau2_record(ex_task))})
        messages.append({"role": "assistant", "content": ex_summary})
    messages.append({"role": "user", "content": source_material(_tau2_record(task))})
    return messages


# --- what the drafter said -----------------------------------------------------------------------
def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def summary_problem(message: dict[str, Any], finish_reason: str | None, private: Iterable[str]) -> tuple[str, str | None]:
    """(the summary text, what is wrong with it or None)."""
    content = message.get("content") if isinstance(message.get("content"), str) else ""
    text = re.sub(r"^\s*<think>.*?</think>", "", content, flags=re.S).strip()  # reasoning inlined by some servers
    if finish_reason == "length":
        return text, "the reply was cut at max_tokens"
    if message.get("tool_calls"):
        return text, "the reply is a tool call, not a summary"
    if not text:
        return text, "the reply is empty"
    if "<think>" in text or "</think>" in text:
        return text, "the reply holds an unclosed reasoning block"
    if text[0] in "{[" or text.startswith("```"):
        return text, "the reply is JSON or code, not prose"
    if len(text) < MIN_SUMMARY_CHARS:
        return text, f"the reply is too short for a summary ({len(text)} characters)"
    if len(text) > MAX_SUMMARY_CHARS:
        return text, f"the reply is too long for a summary ({len(text)} > {MAX_SUMMARY_CHARS} characters)"
    norm = _normal(text)
    for field in private:
        for line in re.split(r"\n+", field):
            if len(_normal(line)) >= COPY_MIN_CHARS and _normal(line) in norm:
                return text, f"the reply copies an instruction line verbatim ({line.strip()[:60]!r}...)"
    return text, None


# --- the output file -----------------------------------------------------------------------------
def existing_output(path: Path) -> SummaryFile:
    """What an earlier run wrote (nothing if no file). A last line cut by a kill mid-write is
    removed (its task is drafted again); any other bad line is refused, the file untouched."""
    if not path.is_file():
        return SummaryFile()
    raw = path.read_text(encoding="utf-8")
    lines = raw.split("\n")
    torn = ""
    if raw and not raw.endswith("\n"):
        try:
            parse_line(lines[-1], "")
        except ValueError:
            torn = lines.pop()
    found = sort_lines(lines, path)  # a bad line is refused here, before anything is written
    if torn:
        path.write_text("".join(line + "\n" for line in lines if line), encoding="utf-8")
        print(f"note: dropped an incomplete last line of {path} ({len(torn)} characters, cut by a kill); "
              "its task is drafted again")
    elif raw and not raw.endswith("\n"):
        with path.open("a", encoding="utf-8") as f:  # a complete last line only missing its newline
            f.write("\n")
    return found


def append_line(path: Path, row: dict[str, Any]) -> None:
    """One line, appended in one write, flushed and fsynced: on disk before the next task."""
    data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# --- the run -------------------------------------------------------------------------------------
@dataclasses.dataclass
class DraftOutcome:
    task_id: str
    status: str  # drafted | error | copied
    attempts: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)


class SummaryDrafter:
    """Drafts the summaries of `tasks` into `out` through `endpoint` (a ChatEndpoint)."""

    def __init__(self, endpoint: Any, out: Path, *, model: str, attempts: int = 3,
                 examples: dict[str, str] | None = None, progress: Callable[[str], None] = print):
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.endpoint, self.out, self.model, self.attempts = endpoint, Path(out), model, attempts
        self.examples = dict(examples or {})
        self.progress = progress
        self._done = 0
        self._total = 0

    def _example_for(self, task: Task) -> tuple[Task, str] | None:
        domain = task.task_id.split("/", 1)[0]
        for tid, summary in sorted(self.examples.items()):
            if tid.startswith(domain + "/") and tid != task.task_id:
                return Task(tid, task.env, split="train", payload={"domain": domain, "tau2_id": tid.split("/", 1)[1]}), summary
        return None

    async def _draft(self, task: Task) -> DraftOutcome:
        messages = draft_messages(task, self._example_for(task))
        private = private_texts(_tau2_record(task))
        outcome = DraftOutcome(task.task_id, "error")
        for _ in range(self.attempts):
            outcome.attempts += 1
            try:
                choice = (await self.endpoint.complete(messages, None, 1))[0]
            except (TransportGaveUp, PermanentRequestError) as e:
                outcome.problems.append(f"request failed: {e}")
                if isinstance(e, PermanentRequestError):
                    break  # the same request fails the same way; do not pay for it again
                continue
            text, problem = summary_problem(choice["message"], choice.get("finish_reason"), private)
            if problem is None:
                append_line(self.out, {"task_id": task.task_id, "summary": text, "reviewed": False,
                                       "model": self.model, "drafted_at": _now()})
                outcome.status = "drafted"
                break
            outcome.problems.append(problem)
        if outcome.status == "error":
            append_line(self.out, {"task_id": task.task_id, "error": "; ".join(outcome.problems),
                                   "attempts": outcome.attempts, "model": self.model, "drafted_at": _now()})
        self._done += 1
        note = f" ({outcome.attempts} attempts)" if outcome.attempts > 1 else ""
        extra = f": {outcome.problems[-1]}" if outcome.status == "error" else ""
        self.progress(f"[{self._done}/{self._total}] {task.task_id[:70]} {outcome.status}{note}{extra}")
        return outcome

    async def run(self, tasks: list[Task]) -> list[DraftOutcome]:
        """Draft every task (none of which has a summary in `out` yet); returns their outcomes."""
        self._total = len(tasks)
        try:
            return list(await asyncio.gather(*(self._draft(t) for t in tasks)))
        finally:
            await self.endpoint.aclose()


def copy_examples(tasks: list[Task], examples: dict[str, str], out: Path) -> list[DraftOutcome]:
    """Tasks that already have a reviewed example summary: copied as reviewed lines, no request."""
    outcomes = []
    for t in tasks:
        if t.task_id in examples:
            append_line(out, {"task_id": t.task_id, "summary": examples[t.task_id], "reviewed": True})
            outcomes.append(DraftOutcome(t.task_id, "copied"))
    return outcomes
