"""Forks of a live AWM episode (envs/fork.py) for the matcher's execution stage.

An AWM episode's state is the SQLite database of its leased server. A fork point copies that
database out once (SQLite's online backup: a read of the live file, nothing written to it) into
the episode's own directory. Each fork then leases a server of the same scenario from the
runtime's fork pool (the same server factory as the episodes': the same sandbox, limits and
call timeout), copies the fork point's database over the server's `episode.db` the way the pool
resets one, runs the call through MCP, reads the database back and gives the server back (the
pool resets it to the scenario's initial database before anyone else gets it). The live
episode's server and file are never written.

The state compared is every table's rows (sorted, so row order is not an effect). A server
fault, a failed lease or an MCP error result is a fork error or failure: the judge decides.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from actionopd_jax.envs.fork import ForkResult, ToolEffects
from actionopd_jax.envs.mcp.client import McpFault
from actionopd_jax.types import ToolCall


def dump_db(path: str | Path) -> dict[str, list]:
    """Every table's rows, sorted (read-only)."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        out = {}
        for t in tables:
            rows = [list(r) for r in con.execute(f'SELECT * FROM "{t.replace(chr(34), chr(34) * 2)}"')]
            out[t] = sorted(rows, key=lambda r: json.dumps(r, default=repr))
        return out
    finally:
        con.close()


class AwmForkPoint:
    """The database of one AWM episode at one decision point (see the module docstring)."""

    def __init__(self, runtime: Any, scenario: str, before_db: Path, tools: list, check, effects):
        self.runtime, self.scenario, self.before_db, self.tools = runtime, scenario, Path(before_db), tools
        self._check, self._effects = check, effects
        self.before = dump_db(self.before_db)
        self._runs = 0

    def effects(self, tool: str) -> ToolEffects:
        return self._effects(tool)

    async def run(self, call: ToolCall) -> ForkResult:
        t0 = time.perf_counter()
        problem = self._check(call, self.tools)
        if problem is not None:
            return ForkResult(observation=f"Error: {problem}", state=self.before, wall_s=time.perf_counter() - t0)
        view = self.runtime.fork_view(self.scenario)
        try:
            server = await view.acquire()
        except McpFault as fault:
            return ForkResult(error=f"no fork server: {fault.end_reason}: {fault.detail}", wall_s=time.perf_counter() - t0)
        ok = False
        try:
            await asyncio.to_thread(self.runtime.load_db, server, self.before_db)
            result = await view.loop.run(server.call(call.name, call.arguments))
            self._runs += 1
            after = self.before_db.with_name(f"{self.before_db.stem}-run{self._runs}.db")
            await asyncio.to_thread(self.runtime.snapshot, server, after)
            state = await asyncio.to_thread(dump_db, after)
            after.unlink(missing_ok=True)
            ok = True
            text = f"Error: {result.text}" if result.is_error else result.text
            return ForkResult(observation=text, state=state, wall_s=time.perf_counter() - t0)
        except McpFault as fault:
            return ForkResult(error=f"fork server failed: {fault.end_reason}: {fault.detail}",
                              wall_s=time.perf_counter() - t0)
        except Exception as err:  # noqa: BLE001 - a fork's failure is "cannot settle", never the episode's
            return ForkResult(error=f"fork failed: {type(err).__name__}: {err}", wall_s=time.perf_counter() - t0)
        finally:
            view.release_soon(server, ok=ok)  # the pool resets its database (or replaces it after a fault)

    def close(self) -> None:
        for p in self.before_db.parent.glob(f"{self.before_db.stem}*.db"):
            p.unlink(missing_ok=True)
