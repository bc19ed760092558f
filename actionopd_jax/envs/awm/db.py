"""Each scenario's initial SQLite database, built once from its schema and sample rows into a
cache directory (keyed by a hash of both), and a file copy of it per episode.

Building follows the published order: per table its DDL, then its indexes, then the sample
INSERTs table by table, with foreign keys on, committed once. A statement that fails is
recorded, not fatal (AWM keeps databases with a small failure ratio); `BuildReport` says how
many failed so the audit can refuse a scenario.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actionopd_jax.envs.awm.layout import AwmScenario

BUILDS = {"count": 0}  # databases built by this process (tests assert the cache is used)
_LOCK = threading.Lock()


@dataclass
class BuildReport:
    statements: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def failure_ratio(self) -> float:
        return self.failed / self.statements if self.statements else 1.0


def db_digest(scenario: AwmScenario) -> str:
    blob = json.dumps([scenario.db_schema, scenario.sample_data], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def build_database(path: Path, db_schema: dict[str, Any], sample_data: dict[str, Any] | None) -> BuildReport:
    report = BuildReport()
    con = sqlite3.connect(path)
    try:
        con.execute("PRAGMA foreign_keys = ON")

        def run(sql: str, where: str) -> None:
            report.statements += 1
            try:
                con.execute(sql)
            except sqlite3.Error as e:
                report.failed += 1
                report.errors.append(f"{where}: {e}")

        for table in db_schema.get("tables", []):
            name = table.get("name", "?")
            run(table.get("ddl", ""), f"table {name}")
            for idx in table.get("indexes", []) or []:
                run(str(idx), f"index on {name}")
            for ex in table.get("examples", []) or []:  # rows some schemas carry inline
                run(str(ex), f"row of {name}")
        for table in (sample_data or {}).get("tables", []):
            for stmt in table.get("insert_statements", []) or []:
                run(str(stmt), f"insert into {table.get('table_name', '?')}")
        con.commit()
    finally:
        con.close()
    return report


class DbCache:
    """`initial(scenario)` -> path of the cached initial DB (built on first use, atomically);
    `episode_copy(scenario, dest_dir)` -> a fresh file copy an episode may write to."""

    def __init__(self, cache_dir: str | Path):
        self.dir = Path(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.reports: dict[str, BuildReport] = {}

    def path_for(self, scenario: AwmScenario) -> Path:
        return self.dir / f"{scenario.name}-{db_digest(scenario)}.db"

    def initial(self, scenario: AwmScenario) -> Path:
        if scenario.db_schema is None:
            raise ValueError(f"scenario {scenario.name!r} has no database schema")
        path = self.path_for(scenario)
        if path.is_file():
            return path
        with _LOCK:
            if path.is_file():
                return path
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".building")
            os.close(fd)
            os.unlink(tmp)  # sqlite creates it
            report = build_database(Path(tmp), scenario.db_schema, scenario.sample_data)
            BUILDS["count"] += 1
            self.reports[scenario.name] = report
            (path.with_suffix(".report.json")).write_text(json.dumps(report.__dict__), encoding="utf-8")
            os.replace(tmp, path)
            os.chmod(path, 0o444)  # the cache is never an episode's database
        return path

    def report(self, scenario: AwmScenario) -> BuildReport:
        """How the cached DB was built (read back from disk when another process built it)."""
        if scenario.name not in self.reports:
            side = self.path_for(scenario).with_suffix(".report.json")
            self.initial(scenario)
            if scenario.name not in self.reports:
                self.reports[scenario.name] = BuildReport(**json.loads(side.read_text(encoding="utf-8")))
        return self.reports[scenario.name]

    def episode_copy(self, scenario: AwmScenario, dest_dir: str | Path, name: str = "episode.db") -> Path:
        dest = Path(dest_dir) / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.initial(scenario), dest)
        os.chmod(dest, 0o644)
        return dest


def table_counts(path: str | Path) -> dict[str, int]:
    """Rows per table (a quick look at a database; tests and the audit use it)."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        return {n: con.execute(f'SELECT COUNT(*) FROM "{n}"').fetchone()[0] for n in names}
    finally:
        con.close()
