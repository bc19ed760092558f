"""Persistent cache for teacher samples and matcher verdicts (paper appendix A.3, "Caching").

Why SQLite in WAL mode: it ships with Python, one file per cache, readers never block the
writer, and every committed transaction survives a killed process (kill -9 cannot corrupt
the database; at worst the entry being written is absent). Each entry is written in its own
transaction, so "every completed entry survives" holds entry by entry. `synchronous=FULL`
also survives power loss; `NORMAL` is faster and still safe against process kills.

Keys are SHA-256 digests of a canonical JSON document (sorted keys, no whitespace) holding
everything that changes the answer: the task/state context messages, tool schemas,
provider, model, prompt and protocol versions, decoding settings, the requested sample
count and any history-dependent state (`key_info`). API keys and endpoints are never part
of a key or a value. The stored value keeps the retained samples in order, so
multiplicity ([A, A, B]) is preserved exactly.

One cache file per host: SQLite locking over network file systems is not reliable.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from actionopd_jax.types import Action, Invalid, Message, TeacherSample, ToolCall, Verdict

# Bump when the meaning of a stored entry changes (parser rules, sample format): old entries
# then stop matching instead of being silently reused.
PROTOCOL_VERSION = "actionopd-cache-v1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS teacher_samples (
    key TEXT PRIMARY KEY,
    samples TEXT NOT NULL,          -- JSON list, in retained order (multiplicity kept)
    provider TEXT NOT NULL,
    model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS verdicts (
    key TEXT PRIMARY KEY,
    verdict TEXT NOT NULL CHECK (verdict IN ('match', 'no_match')),
    model TEXT NOT NULL,
    created REAL NOT NULL
);
"""


def stable_digest(document: Any) -> str:
    """SHA-256 of the canonical JSON text of `document` (sorted keys, compact, UTF-8)."""
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_reject)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _reject(obj: Any) -> Any:
    raise TypeError(f"cache key part of type {type(obj).__name__} is not JSON data; pass plain dicts/lists/str/numbers")


def teacher_cache_key(
    *,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    identity: dict[str, Any],
    k: int,
    key_info: dict[str, Any] | None = None,
) -> str:
    """Key of one teacher request: state context + tools + who/how was asked + K."""
    return stable_digest(
        {
            "protocol": PROTOCOL_VERSION,
            "kind": "teacher_samples",
            "identity": identity,
            "messages": messages,
            "tools": tools,
            "k": k,
            "key_info": key_info or {},
        }
    )


# --- (de)serialisation of samples -----------------------------------------------------------


def action_to_json(action: Action) -> dict[str, Any]:
    if isinstance(action, ToolCall):
        return {"kind": "tool_call", "name": action.name, "arguments": action.arguments}
    if isinstance(action, Message):
        return {"kind": "message", "text": action.text}
    if isinstance(action, Invalid):
        return {"kind": "invalid", "reason": action.reason}
    raise TypeError(f"not an Action: {type(action).__name__}")


def action_from_json(d: dict[str, Any]) -> Action:
    kind = d.get("kind")
    if kind == "tool_call":
        return ToolCall(d["name"], d["arguments"])
    if kind == "message":
        return Message(d["text"])
    if kind == "invalid":
        return Invalid(d["reason"])
    raise ValueError(f"corrupt cached action kind {kind!r}")


def sample_to_json(s: TeacherSample) -> dict[str, Any]:
    return {
        "text": s.text,
        "action": action_to_json(s.action),
        "reasoning": s.reasoning,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
    }


def sample_from_json(d: dict[str, Any]) -> TeacherSample:
    return TeacherSample(
        text=d["text"],
        action=action_from_json(d["action"]),
        reasoning=d.get("reasoning", ""),
        prompt_tokens=int(d.get("prompt_tokens", 0)),
        completion_tokens=int(d.get("completion_tokens", 0)),
        from_cache=True,
    )


class PersistentCache:
    """One SQLite file holding teacher samples and matcher verdicts.

    Safe to share between asyncio tasks and threads of one process (a lock serialises the
    connection) and between processes on one host (SQLite file locking, WAL readers).
    """

    def __init__(self, path: str | Path, *, synchronous: str = "FULL", busy_timeout_s: float = 30.0):
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', got {synchronous!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per entry.
        self._conn = sqlite3.connect(
            str(self.path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise RuntimeError(f"could not put {self.path} in WAL mode (got {mode!r}); is it on a network file system?")
        self._conn.execute(f"PRAGMA synchronous={synchronous}")
        self._conn.executescript(_SCHEMA)

    # --- teacher samples -------------------------------------------------------------------
    def get_samples(self, key: str) -> list[TeacherSample] | None:
        with self._lock:
            row = self._conn.execute("SELECT samples FROM teacher_samples WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        return [sample_from_json(d) for d in json.loads(row[0])]

    def put_samples(self, key: str, samples: list[TeacherSample], *, provider: str, model: str) -> None:
        payload = json.dumps([sample_to_json(s) for s in samples], ensure_ascii=False)
        prompt = sum(s.prompt_tokens for s in samples)
        completion = sum(s.completion_tokens for s in samples)
        self._write(
            "INSERT OR REPLACE INTO teacher_samples VALUES (?, ?, ?, ?, ?, ?, ?)",
            (key, payload, provider, model, prompt, completion, time.time()),
        )

    # --- matcher verdicts (only definite ones: "unavailable" is never cached) ---------------
    def get_verdict(self, key: str) -> Verdict | None:
        with self._lock:
            row = self._conn.execute("SELECT verdict FROM verdicts WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def put_verdict(self, key: str, verdict: Verdict, *, model: str) -> None:
        if verdict not in ("match", "no_match"):
            raise ValueError(f"only definite verdicts are cached, got {verdict!r}")
        self._write("INSERT OR REPLACE INTO verdicts VALUES (?, ?, ?, ?)", (key, verdict, model, time.time()))

    # --- reporting / lifecycle -------------------------------------------------------------
    def summary(self) -> dict[str, int]:
        """Entries held and the tokens their creation cost (what a warm rerun saves)."""
        with self._lock:
            n, p, c = self._conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) FROM teacher_samples"
            ).fetchone()
            v = self._conn.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0]
        return {"teacher_entries": n, "verdict_entries": v, "stored_prompt_tokens": p, "stored_completion_tokens": c}

    def integrity_ok(self) -> bool:
        with self._lock:
            return self._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> "PersistentCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PersistentCache({str(self.path)!r})"

    def _write(self, sql: str, params: tuple) -> None:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute(sql, params)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
