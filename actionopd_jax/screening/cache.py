"""The screen's verdict cache: one SQLite file (WAL, one transaction per verdict, as the
teacher's cache: teacher/cache.py says why), so a screen that is stopped keeps every verdict it
paid for and a re-run asks only for what is missing.

A key is the digest of what decides the answer: the task's source hash, the prompt version, the
character budget the prompt was cut to and the judge's identity (provider, model, decoding
settings). A task whose source changed therefore misses and is asked again; an unchanged one is
never asked twice. Only verdicts are stored: an error (no parseable reply, endpoint down) is not
an answer about the task and is asked again on the next run. No key, URL or header is stored.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from actionopd_jax.teacher.cache import stable_digest

PROTOCOL = "screen-cache-v1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS screen_verdicts (
    key TEXT PRIMARY KEY,
    task_id TEXT NOT NULL,
    record TEXT NOT NULL,            -- JSON: the manifest's screening record
    created REAL NOT NULL
);
"""


def screen_key(*, source_hash: str, prompt_version: str, max_chars: int, identity: dict[str, Any]) -> str:
    return stable_digest({"protocol": PROTOCOL, "source_hash": source_hash, "prompt_version": prompt_version,
                          "max_chars": max_chars, "identity": identity})


class ScreenCache:
    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), timeout=busy_timeout_s, isolation_level=None,
                                     check_same_thread=False)
        mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise RuntimeError(f"could not put {self.path} in WAL mode (got {mode!r}); is it on a network file system?")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(_SCHEMA)

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._conn.execute("SELECT record FROM screen_verdicts WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, key: str, task_id: str, record: dict[str, Any]) -> None:
        if record.get("verdict") not in ("feasible", "infeasible"):
            raise ValueError(f"only verdicts are cached, got {record.get('verdict')!r}")
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute("INSERT OR REPLACE INTO screen_verdicts VALUES (?, ?, ?, ?)",
                                   (key, task_id, json.dumps(record, ensure_ascii=False), time.time()))
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM screen_verdicts").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> "ScreenCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
