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

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from actionopd_jax.matching.matcher import Matcher, rules_decision
from actionopd_jax.teacher.cache import action_from_json, action_to_json, stable_digest
from actionopd_jax.types import Action, ChatMessage, ToolCall, ToolSchema, Verdict

log = logging.getLogger(__name__)

LOG_VERSION = 1
_DIGEST = re.compile(r'^\{"d": "([0-9a-f]{32})", "v": .*\}$')  # a whole blob line, as _blob writes it


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
        self._seen = _blob_digests(self.blobs) if self.blobs.exists() else set()
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
        except Exception as err:  # noqa: BLE001 - a full disk, a value JSON cannot hold
            # a diagnostic record must not end a trajectory or stop training; say so once, loudly
            if not self._warned:
                log.warning("judged-pair log %s not written (%s); `audit-matcher` will miss these states",
                            self.path, err)
                self._warned = True

    def _record(self, step, task_start, task_id, env, decision, messages, tools, candidates, teacher, verdicts,
                matcher, evidence_env) -> None:
        if self._lines is None or self._lines.closed:
            self._lines, self._blob_file = _append(self.path), _append(self.blobs)
        stage_of = getattr(matcher, "stage", None) or (lambda a, b: rules_decision(a, b).stage)
        if isinstance(matcher, Matcher):  # it knows the pairs its execution stage decided at this state
            stage_of = functools.partial(matcher.stage, messages=messages)
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
    """One state group read back from the log. Its context (messages, tools, evidence) is
    filled in by `resolve_context`, for the states a caller needs: a long run's blobs need
    not all be in memory to count its pairs."""

    step: int
    task_start: int
    task_id: str
    env: str
    decision: int
    candidates: list[Action]
    teacher: list[Action]
    stages: list[list[str]]
    verdicts: list[list[Verdict]]
    refs: dict[str, Any]                     # the blob digests of messages, tools, evidence
    blobs_file: str                          # where they are
    messages: list[ChatMessage] | None = None
    tools: list[ToolSchema] | None = None
    evidence: dict[str, str] | None = None

    @property
    def resolved(self) -> bool:
        return self.messages is not None


@dataclass
class ReadReport:
    files: int = 0
    lines: int = 0
    skipped_lines: int = 0       # cut off by a crash, or not a state record
    missing_context: int = 0     # states whose context blobs are absent (set by resolve_context)
    duplicates: int = 0          # re-collected states (the last one is kept)


def read_judged(run_dir: str | Path) -> tuple[list[JudgedState], ReadReport]:
    """Every state group of the run's judged-pair logs (all processes), the last record of
    each (step, task start, decision), in that order; contexts not yet resolved."""
    run_dir = Path(run_dir)
    report = ReadReport()
    states: dict[tuple[int, int, int], JudgedState] = {}
    for path in sorted(run_dir.glob("judged-p*.jsonl")):
        report.files += 1
        blobs = path.name.replace("judged-p", "judged-blobs-p")
        with open(path, encoding="utf-8") as f:
            for text in f:
                report.lines += 1
                state = _parse_state(text, blobs)
                if state is None:
                    report.skipped_lines += 1
                    continue
                key = (state.step, state.task_start, state.decision)
                report.duplicates += key in states
                states[key] = state
    return [states[k] for k in sorted(states)], report


def resolve_context(run_dir: str | Path, states: Sequence[JudgedState], report: ReadReport) -> None:
    """Fill in the context of `states` from the blob files, reading only the blobs they
    reference; a state whose blobs are missing stays unresolved (counted in `report`)."""
    run_dir = Path(run_dir)
    by_file: dict[str, list[JudgedState]] = {}
    for st in states:
        if not st.resolved:
            by_file.setdefault(st.blobs_file, []).append(st)
    for name, group in by_file.items():
        wanted = {r for st in group for r in _digests(st.refs)}
        blobs, _ = _read_blobs(run_dir / name, wanted)
        for st in group:
            if any(r not in blobs for r in _digests(st.refs)):
                report.missing_context += 1
                continue
            st.messages = [blobs[r] for r in st.refs["messages"]]
            st.tools = blobs[st.refs["tools"]]
            st.evidence = {tool: blobs[r] for tool, r in st.refs["evidence"].items()}


def _digests(refs: dict[str, Any]) -> list[str]:
    return [*refs["messages"], refs["tools"], *refs["evidence"].values()]


def _parse_state(text: str, blobs_file: str) -> JudgedState | None:
    try:
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("v") != LOG_VERSION:
            raise ValueError("not a judged-pair record")
        refs = {"messages": list(d["messages"]), "tools": d["tools"], "evidence": dict(d["evidence"])}
        return JudgedState(
            step=int(d["step"]), task_start=int(d["task_start"]), task_id=str(d["task_id"]), env=str(d["env"]),
            decision=int(d["decision"]), candidates=[action_from_json(a) for a in d["candidates"]],
            teacher=[action_from_json(a) for a in d["teacher"]], stages=d["stages"], verdicts=d["verdicts"],
            refs=refs, blobs_file=blobs_file)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _append(path: Path):
    """The file opened for appending whole lines: a line a crash cut off is ended first, so
    the next record does not run into it."""
    cut = path.exists() and path.stat().st_size > 0 and path.read_bytes()[-1:] != b"\n"
    f = open(path, "a", buffering=1, encoding="utf-8")
    if cut:
        f.write("\n")
    return f


def _read_blobs(path: Path, wanted: set[str] | None = None) -> tuple[dict[str, Any], int]:
    """The blobs of `path` ({digest: value}; only `wanted` ones when given) and the number of
    unreadable lines (cut off by a crash)."""
    out: dict[str, Any] = {}
    bad = 0
    if not path.exists():
        return out, bad
    with open(path, encoding="utf-8") as f:
        for text in f:
            head = _DIGEST.match(text)
            if wanted is not None and head is not None and head.group(1) not in wanted:
                continue  # skipped without parsing the value
            try:
                d = json.loads(text)
                out[d["d"]] = d["v"]
            except (ValueError, KeyError, TypeError):
                bad += 1
    return out, bad


def _blob_digests(path: Path) -> set[str]:
    """The digests a blob file holds, without parsing the values."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out = {m.group(1) for m in map(_DIGEST.match, lines[:-1]) if m is not None}
    if lines and _DIGEST.match(lines[-1]):   # only the last line can be one a crash cut off
        try:
            out.add(json.loads(lines[-1])["d"])
        except ValueError:
            pass
    return out
