"""The judged-pair log: every (candidate, teacher sample) pair the matcher decided during
collection, with what decided it, so `actionopd audit-matcher` can ask a second judge the
same question later (matching/audit_cli.py).

Two append-only files per collecting process, in the run directory:

    judged-p<i>.jsonl        one line per state group: step, task start, task id, environment,
                             decision index; the N candidate and K teacher actions; for every
                             pair its stage (Matcher.stage) and verdict; the public context,
                             tools and tool evidence the judge was shown, as digests
    judged-blobs-p<i>.jsonl  {"d": digest, "v": value}: each message, tool list and evidence
                             text once

The context is stored by reference because consecutive states of a trajectory share all but
their last messages: inline, a run's log would grow with the square of its conversations'
length; by digest it grows with what was said. Nothing here holds a secret: the context is
the conversation the judge already saw. A state collected twice (a step re-run after a crash
before its checkpoint) appears twice; readers keep the last line of each (step, task start,
decision). A line cut off by a crash is skipped and counted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from actionopd_jax.matching.matcher import rules_decision
from actionopd_jax.teacher.cache import action_from_json, action_to_json, stable_digest
from actionopd_jax.types import Action, ChatMessage, ToolCall, ToolSchema, Verdict

log = logging.getLogger(__name__)

LOG_VERSION = 1


def log_path(run_dir: str | Path, process_index: int) -> Path:
    return Path(run_dir) / f"judged-p{process_index}.jsonl"


def blobs_path(run_dir: str | Path, process_index: int) -> Path:
    return Path(run_dir) / f"judged-blobs-p{process_index}.jsonl"


class JudgedLog:
    """Writer of one process's judged-pair log (see the module docstring)."""

    def __init__(self, run_dir: str | Path, process_index: int = 0):
        self.path = log_path(run_dir, process_index)
        self.blobs = blobs_path(run_dir, process_index)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a resumed run appends: the blobs already written need not be written again
        self._seen = set(_read_blobs(self.blobs)[0]) if self.blobs.exists() else set()
        self._lines = self._blob_file = None  # opened at the first record (again after close)
        self._warned = False

    def record(self, *, step: int, task_start: int, task_id: str, env: str, decision: int,
               messages: list[ChatMessage], tools: list[ToolSchema], candidates: Sequence[Action],
               teacher: Sequence[Action], verdicts: Sequence[Sequence[Verdict]], matcher: Any,
               evidence_env: str | None = None) -> None:
        """Append one state group. `matcher`: the run's Matcher (its `stage` and
        `evidence_for` say what decided each pair and what evidence the judge saw);
        `evidence_env`: the scope the matcher was given (envs.evidence.evidence_scope)."""
        try:
            self._record(step, task_start, task_id, env, decision, messages, tools, candidates, teacher, verdicts,
                         matcher, evidence_env)
        except OSError as err:
            # a diagnostic record must not stop training; say so once, loudly
            if not self._warned:
                log.warning("judged-pair log %s not written (%s); `audit-matcher` will miss these states",
                            self.path, err)
                self._warned = True

    def _record(self, step, task_start, task_id, env, decision, messages, tools, candidates, teacher, verdicts,
                matcher, evidence_env) -> None:
        if self._lines is None or self._lines.closed:
            self._lines, self._blob_file = _append(self.path), _append(self.blobs)
        stage_of = getattr(matcher, "stage", None) or (lambda a, b: rules_decision(a, b).stage)
        stages = [[stage_of(c, t) for t in teacher] for c in candidates]
        evidence: dict[str, str] = {}
        evidence_for = getattr(matcher, "evidence_for", None)
        if callable(evidence_for):
            for c in candidates:  # every tool the audit may ask about, not only the judged ones
                if isinstance(c, ToolCall) and c.name not in evidence:
                    text = evidence_for(c.name, evidence_env)[0]
                    if text:
                        evidence[c.name] = self._blob(text)
        line = {"v": LOG_VERSION, "step": int(step), "task_start": int(task_start), "task_id": task_id, "env": env,
                "decision": int(decision), "messages": [self._blob(m) for m in messages], "tools": self._blob(tools),
                "evidence": evidence, "candidates": [action_to_json(c) for c in candidates],
                "teacher": [action_to_json(t) for t in teacher], "stages": stages,
                "verdicts": [list(row) for row in verdicts]}
        self._lines.write(json.dumps(line, ensure_ascii=False) + "\n")

    def _blob(self, value: Any) -> str:
        digest = stable_digest(value)[:32]
        if digest not in self._seen:
            self._blob_file.write(json.dumps({"d": digest, "v": value}, ensure_ascii=False) + "\n")
            self._seen.add(digest)
        return digest

    def close(self) -> None:
        """Close the files; a later record opens them again (the collector is reused after close)."""
        for f in (self._lines, self._blob_file):
            if f is not None:
                f.close()


@dataclass
class JudgedState:
    """One state group read back from the log, its context resolved."""

    step: int
    task_start: int
    task_id: str
    env: str
    decision: int
    messages: list[ChatMessage]
    tools: list[ToolSchema]
    evidence: dict[str, str]
    candidates: list[Action]
    teacher: list[Action]
    stages: list[list[str]]
    verdicts: list[list[Verdict]]

    @property
    def ref(self) -> str:
        return f"step {self.step}, task start {self.task_start} ({self.task_id}), decision {self.decision}"


@dataclass
class ReadReport:
    files: int = 0
    lines: int = 0
    skipped_lines: int = 0       # cut off by a crash, or not a state record
    missing_context: int = 0     # a referenced blob is absent
    duplicates: int = 0          # re-collected states (the last one is kept)


def read_judged(run_dir: str | Path) -> tuple[list[JudgedState], ReadReport]:
    """Every state group of the run's judged-pair logs (all processes), the last record of
    each (step, task start, decision), in that order."""
    run_dir = Path(run_dir)
    report = ReadReport()
    states: dict[tuple[int, int, int], JudgedState] = {}
    for path in sorted(run_dir.glob("judged-p*.jsonl")):
        report.files += 1
        blobs, bad_blobs = _read_blobs(run_dir / path.name.replace("judged-p", "judged-blobs-p"))
        report.skipped_lines += bad_blobs
        with open(path, encoding="utf-8") as f:
            for text in f:
                report.lines += 1
                state = _parse_state(text, blobs, report)
                if state is None:
                    continue
                key = (state.step, state.task_start, state.decision)
                report.duplicates += key in states
                states[key] = state
    return [states[k] for k in sorted(states)], report


def _parse_state(text: str, blobs: dict[str, Any], report: ReadReport) -> JudgedState | None:
    try:
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("v") != LOG_VERSION:
            raise ValueError("not a judged-pair record")
        refs = [*d["messages"], d["tools"], *d["evidence"].values()]
        if any(r not in blobs for r in refs):
            report.missing_context += 1
            return None
        return JudgedState(
            step=int(d["step"]), task_start=int(d["task_start"]), task_id=str(d["task_id"]), env=str(d["env"]),
            decision=int(d["decision"]), messages=[blobs[r] for r in d["messages"]], tools=blobs[d["tools"]],
            evidence={name: blobs[r] for name, r in d["evidence"].items()},
            candidates=[action_from_json(a) for a in d["candidates"]],
            teacher=[action_from_json(a) for a in d["teacher"]], stages=d["stages"], verdicts=d["verdicts"])
    except (ValueError, KeyError, TypeError, AttributeError):
        report.skipped_lines += 1
        return None


def _append(path: Path):
    """The file opened for appending whole lines: a line a crash cut off is ended first, so
    the next record does not run into it."""
    cut = path.exists() and path.stat().st_size > 0 and path.read_bytes()[-1:] != b"\n"
    f = open(path, "a", buffering=1, encoding="utf-8")
    if cut:
        f.write("\n")
    return f


def _read_blobs(path: Path) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    bad = 0
    if not path.exists():
        return out, bad
    with open(path, encoding="utf-8") as f:
        for text in f:
            try:
                d = json.loads(text)
                out[d["d"]] = d["v"]
            except (ValueError, KeyError, TypeError):
                bad += 1  # a line cut off by a crash
    return out, bad
