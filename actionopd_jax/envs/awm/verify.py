"""Task success for an AWM episode from its initial and final databases.

Two published modes (docs/formats.md):
- "code": the verifier function returns {"result": "complete" | "others"}; that is the verdict.
- "sql": the verifier function returns facts about the two databases (a JSON dict); a judge
  model reads the task, the agent's trajectory and those facts, and classifies the episode as
  complete / incomplete / server_error / agent_error. `verify_sql` takes the judge as a callable
  (messages -> reply text) so the run's judge endpoint is wired in by the caller.

Verifier code is machine-generated: it runs only through a `Sandbox` (envs/sandbox.py), on
read-only copies of the two databases, never in this process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from actionopd_jax.envs.sandbox import Sandbox
from actionopd_jax.envs.scratch import scratch_dir

CODE_VERDICTS = ("complete", "others")
JUDGE_CLASSES = ("complete", "incomplete", "server_error", "agent_error")
Judge = Callable[[list[dict[str, Any]]], str]


@dataclass
class Verdict:
    verdict: str  # "complete" | "others" (code) | one of JUDGE_CLASSES (sql) | "judge_error"
    mode: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        return self.verdict == "complete"

    @property
    def reward(self) -> float:
        return 1.0 if self.success else 0.0


def _readonly_copies(initial_db: str | Path, final_db: str | Path, workdir: str) -> tuple[str, str]:
    out = []
    for label, src in (("initial", initial_db), ("final", final_db)):
        if not Path(src).is_file():
            raise FileNotFoundError(f"{label} database not found: {src}")
        dst = os.path.join(workdir, f"{label}.db")
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o444)
        out.append(dst)
    return out[0], out[1]


def run_verifier_code(entry: dict[str, Any], initial_db: str | Path, final_db: str | Path, *, sandbox: Sandbox,
                      final_answer: str = "", timeout_s: float = 30.0) -> tuple[bool, Any, str]:
    """(ran, returned value, error) of a verifier entry {"code", "function_name"}."""
    with tempfile.TemporaryDirectory(prefix="awm-verify-", dir=scratch_dir()) as workdir:
        a, b = _readonly_copies(initial_db, final_db, workdir)
        res = sandbox.run_function(entry["code"], entry["function_name"],
                                   {"initial_db_path": a, "final_db_path": b, "final_answer": final_answer or ""},
                                   timeout_s=timeout_s, read_paths=(workdir,))
    return res.ok, res.value, res.error


def verify_code(entry: dict[str, Any], initial_db: str | Path, final_db: str | Path, *, sandbox: Sandbox,
                final_answer: str = "", timeout_s: float = 30.0) -> Verdict:
    ran, value, error = run_verifier_code(entry, initial_db, final_db, sandbox=sandbox, final_answer=final_answer,
                                          timeout_s=timeout_s)
    if not ran:
        return Verdict("judge_error", "code", {"error": error})
    if not isinstance(value, dict) or "result" not in value:
        return Verdict("judge_error", "code", {"error": f"verifier returned {type(value).__name__}, not {{'result': ...}}"})
    result = str(value["result"]).lower()
    return Verdict(result if result in CODE_VERDICTS else "others", "code", {"raw_result": value})


def judge_messages(task: str, facts: Any, entry: dict[str, Any], trajectory: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The judge's prompt (our wording): the task, what the agent did, the verifier's code, its
    criteria and the facts it returned; the answer is one JSON object with a classification."""
    raw = entry.get("raw") or {}
    system = (
        "You grade whether an AI agent completed a task in a simulated application backed by a SQLite database. "
        "You get the task, the agent's trajectory, and the output of a Python check that read the database before "
        "and after the episode (the check itself may be imperfect: weigh it against the trajectory). "
        "Classify the episode as exactly one of: complete (the task was done and the database agrees), "
        "server_error (the environment failed in a way that blocked the agent), agent_error (the agent made a "
        "mistake it did not recover from), incomplete (anything else not finished). "
        'Answer with one JSON object only: {"classification": "<class>", "reasoning": "<one or two sentences>"}.')
    payload = {"task": task, "trajectory": trajectory, "check_code": entry.get("code", ""),
               "success_criteria": raw.get("success_criteria", ""), "failure_criteria": raw.get("failure_criteria", ""),
               "check_output": facts}
    return [{"role": "system", "content": system},
            {"role": "user", "content": json.dumps(payload, ensure_ascii=False, indent=1, default=str)}]


def parse_judge_reply(text: str) -> tuple[str, dict[str, Any]]:
    """(classification or "judge_error", parsed object); tolerant of text around one JSON object."""
    obj: Any = None
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        m = re.search(r"\{.*\}", text or "", re.S)
        if m:
            try:
                obj = json.loads(m.group(0))
            except json.JSONDecodeError:
                obj = None
    if not isinstance(obj, dict):
        return "judge_error", {"error": "unparsable judge reply", "reply": (text or "")[:500]}
    cls = str(obj.get("classification", "")).strip().lower()
    return (cls if cls in JUDGE_CLASSES else "judge_error"), obj


def verify_sql(entry: dict[str, Any], task: str, initial_db: str | Path, final_db: str | Path, *, sandbox: Sandbox,
               judge: Judge, trajectory: list[dict[str, Any]] | None = None, timeout_s: float = 30.0) -> Verdict:
    ran, facts, error = run_verifier_code(entry, initial_db, final_db, sandbox=sandbox, timeout_s=timeout_s)
    if not ran:
        return Verdict("judge_error", "sql", {"error": error})
    try:
        reply = judge(judge_messages(task, facts, entry, trajectory or []))
    except Exception as e:  # the endpoint failed: not a verdict on the agent
        return Verdict("judge_error", "sql", {"error": f"judge call failed: {type(e).__name__}: {e}", "facts": facts})
    cls, parsed = parse_judge_reply(reply)
    return Verdict(cls, "sql", {"facts": facts, "judge": parsed})
