"""The privileged-summaries file (Self-ActionOPD on tau2, paper B.5): JSON lines, one object a
line, read into what training may use (reviewed summaries), what still waits for a human
(drafted, unreviewed) and what failed to draft (error lines).

Three kinds of line (docs/formats.md, "Privileged summaries"):

- a reviewed summary: `{"task_id", "summary", "reviewed": true}`, optionally with the `model` /
  `drafted_at` it was drafted with (hand-written lines have neither). Only a line that SAYS
  `"reviewed": true` is one (issue 43 item 7: a line without the key counted as reviewed, so a
  draft that lost its flag, or a line nobody checked, trained the teacher);
- a summary not (yet) reviewed: the same with `"reviewed": false` (what `actionopd tau2
  summaries` writes) or without the key. Training never uses it: a human reads it, edits it if
  needed and sets `"reviewed": true` (the paper's summaries were reviewed before training);
- an error line: `{"task_id", "error", ...}`, a task whose drafts were all garbled or empty.
  It holds no summary; a later summary line for the same task supersedes it.

Each task has at most one summary line. Unknown keys are refused, so a typo is not ignored.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

REQUIRED_KEYS = ("task_id",)
OPTIONAL_KEYS = ("summary", "reviewed", "model", "drafted_at", "error", "attempts")


@dataclasses.dataclass
class SummaryFile:
    """A summaries file, by task id."""

    reviewed: dict[str, str] = dataclasses.field(default_factory=dict)
    unreviewed: dict[str, str] = dataclasses.field(default_factory=dict)   # "reviewed": false, or no key
    unmarked: set[str] = dataclasses.field(default_factory=set)   # of those, the lines without the key
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # task -> its last draft error

    def has_summary(self, task_id: str) -> bool:
        return task_id in self.reviewed or task_id in self.unreviewed


def _row_problem(row: Any) -> str | None:
    """What is wrong with one parsed line, or None."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    unknown = sorted(set(row) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        return f"unknown key(s) {unknown}; a line holds task_id plus {list(OPTIONAL_KEYS)}"
    if not (isinstance(row.get("task_id"), str) and row["task_id"].strip()):
        return "task_id must be a non-empty string"
    if ("summary" in row) == ("error" in row):
        return "a line holds either a summary or an error, exactly one of them"
    if "summary" in row and not (isinstance(row["summary"], str) and row["summary"].strip()):
        return "task_id and summary must be non-empty strings"
    if "reviewed" in row and not isinstance(row["reviewed"], bool):
        return f"reviewed must be true or false, got {row['reviewed']!r}"
    if "error" in row and "reviewed" in row:
        return "an error line has nothing to review; drop its 'reviewed' key"
    return None


def parse_line(line: str, where: str) -> dict[str, Any]:
    """One line as a checked dict; ValueError names `where` and the fault."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON ({e.msg}); each line is one {{\"task_id\", \"summary\"}} object") from None
    problem = _row_problem(row)
    if problem:
        raise ValueError(f"{where}: {problem}")
    return row


def sort_lines(lines: list[str], path: Path) -> SummaryFile:
    """Lines of the file at `path` sorted into reviewed / unreviewed / failed (blank lines
    skipped); ValueError names the first bad line and its fault."""
    out = SummaryFile()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        row = parse_line(line, where)
        task = row["task_id"]
        if "error" in row:
            if not out.has_summary(task):
                out.failed[task] = str(row["error"])
            continue
        if out.has_summary(task):
            raise ValueError(f"{where}: task {task!r} has a second summary; give each task one")
        out.failed.pop(task, None)
        bucket = out.reviewed if row.get("reviewed") is True else out.unreviewed
        bucket[task] = row["summary"].strip()
        if "reviewed" not in row:
            out.unmarked.add(task)
    return out


def read_summary_file(path: str | Path) -> SummaryFile:
    """The file's lines sorted into reviewed / unreviewed / failed; a bad file is refused with
    the line and what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"privileged summaries file {p} does not exist (teacher.privileged_summaries; "
                                "format: docs/formats.md, 'Privileged summaries')")
    lines = p.read_text(encoding="utf-8").splitlines()
    if not any(line.strip() for line in lines):
        raise ValueError(f"{p} holds no summaries")
    return sort_lines(lines, p)
