"""What AWM episodes share in one process: the pool directory, the initial-database cache, the
verifier modes of the admission manifest, and a bounded pool of the scenarios' generated
servers (one kind of server per scenario, envs/mcp/keyed_pool.py).

A server starts contained (envs/mcp/sandbox.py) with a private directory that already holds
a copy of its scenario's cached initial database (`episode.db`; `DATABASE_PATH` points at it,
as AWM's launcher sets it). It speaks MCP over stdio itself, or it is a published FastAPI app
that `fastapi_host.py` serves over streamable HTTP on a free loopback port (envs/awm/modes.py). Between episodes the pool resets it by
ending every process its tools started (envs/mcp/strays.py), then copying the cached file over `episode.db` again, through SQLite's online-backup API so that the
server's open connections see the new content (no server restart, no inserts re-run).
At an episode's end `snapshot` copies `episode.db` out for the verifier before the reset.
"""

from __future__ import annotations

import ast
import shutil
import sqlite3
import tempfile
import threading
from pathlib import Path
from typing import Any

from actionopd_jax import pyast
from actionopd_jax.envs.awm.db import DbCache
from actionopd_jax.envs.awm.layout import AwmDataset, AwmScenario
from actionopd_jax.envs.awm.modes import server_command, server_mode
from actionopd_jax.envs.awm.serve import EPISODE_DB, EpisodeDbSandbox
from actionopd_jax.envs.mcp.client import McpServer, ServerSpec
from actionopd_jax.envs.mcp.convert import tool_evidence
from actionopd_jax.envs.mcp.keyed_pool import KeyedPool, PoolView
from actionopd_jax.envs.mcp.sandbox import Limits, Sandbox
from actionopd_jax.envs.scratch import scratch_dir

DEFAULT_CACHE = Path.home() / ".cache" / "actionopd_jax" / "awm_db"  # content-addressed: shared safely


def copy_db(src: str | Path, dst: str | Path) -> None:
    """Replace the content of database `dst` by that of `src` (SQLite's backup API: page by
    page under the destination's write lock, safe while another process has it open)."""
    source = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    try:
        dest = sqlite3.connect(str(dst), timeout=10)
        try:
            source.backup(dest)
        finally:
            dest.close()
    finally:
        source.close()


def tool_sources(code: str | None) -> dict[str, str]:
    """Tool name -> the source of the function implementing it in generated server code (its
    decorators included), read with `ast` (nothing runs). A function is named by itself and by
    any string `name=` / `operation_id=` argument of its decorators (MCP tool names, FastAPI
    operation ids, which fastapi-mcp turns into tool names)."""
    if not code:
        return {}
    try:
        tree = pyast.parse(code)
    except SyntaxError:
        return {}
    lines = code.splitlines()
    out: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = min([d.lineno for d in node.decorator_list] + [node.lineno])
        text = "\n".join(lines[first - 1:node.end_lineno])
        names = [node.name]
        for d in node.decorator_list:
            if isinstance(d, ast.Call):
                names += [k.value.value for k in d.keywords if k.arg in ("name", "operation_id")
                          and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)]
        for name in names:
            out.setdefault(name, text)
    return out


class AwmRuntime:
    """`dataset`: the loaded pool; `modes`: task id -> "code" | "sql" (the manifest's
    verifier_modes; a task without one uses code where present, else sql); `judge`: the SQL
    mode's judge callable (envs/awm/judge.py) or None; `pool_size`: servers at most."""

    def __init__(self, dataset: AwmDataset, *, pool_size: int, modes: dict[str, str] | None = None,
                 judge: Any = None, cache_dir: str | Path | None = None, call_timeout_s: float = 30.0,
                 start_timeout_s: float = 60.0, limits: Limits | None = None, sandbox: Any = None,
                 fork_pool_size: int = 2):
        self.dataset = dataset
        self.modes = dict(modes or {})
        self.judge = judge
        self.cache = DbCache(cache_dir or DEFAULT_CACHE)
        self.pool_size = pool_size
        self.call_timeout_s, self.start_timeout_s = call_timeout_s, start_timeout_s
        self.limits = limits or Limits()
        self._sandbox = sandbox  # for verifiers (envs/sandbox.py); built on first use
        self._code_dir = Path(tempfile.mkdtemp(prefix="awm-code-", dir=scratch_dir()))  # swept after a kill -9
        self._code: dict[str, Path] = {}
        self._pool: KeyedPool | None = None
        self._fork_pool: KeyedPool | None = None  # the matcher's forks (envs/awm/fork.py): never an episode's servers
        self.fork_pool_size = fork_pool_size
        self._lock = threading.Lock()
        self.tools: dict[str, list] = {}  # scenario -> what its server's tools/list gave

    # --- parts built on first use (--check builds a runtime and starts nothing) ---------------

    @property
    def pool(self) -> KeyedPool:
        with self._lock:
            if self._pool is None:
                self._pool = KeyedPool(self._server, size=self.pool_size, reset=self._reset)
            return self._pool

    def fork_view(self, scenario: str) -> PoolView:
        """Servers for the matcher's forks: the episodes' server factory and reset, a pool of
        their own (a fork never waits for, nor takes, an episode's server)."""
        with self._lock:
            if self._fork_pool is None:
                self._fork_pool = KeyedPool(self._server, size=self.fork_pool_size, reset=self._reset,
                                            loop=self._pool.loop if self._pool is not None else None)
        return self._fork_pool.view(scenario)

    def load_db(self, server: McpServer, source: Path) -> None:
        """Put `source`'s content in a leased fork server's database (as the pool's reset does)."""
        copy_db(source, Path(server.workdir) / EPISODE_DB)

    @property
    def sandbox(self):
        if self._sandbox is None:
            from actionopd_jax.envs.sandbox import SubprocessSandbox

            self._sandbox = SubprocessSandbox()
        return self._sandbox

    def scenario(self, name: str) -> AwmScenario:
        try:
            return self.dataset.scenarios[name]
        except KeyError:
            raise ValueError(f"scenario {name!r} is not in the AWM directory {self.dataset.root}") from None

    def view(self, scenario: str) -> PoolView:
        return self.pool.view(scenario)

    def verifier_mode(self, task_id: str, scenario: AwmScenario, task_idx: int) -> str:
        if task_id in self.modes:
            return self.modes[task_id]
        return "code" if scenario.verifier(task_idx, "code") is not None else "sql"

    # --- servers --------------------------------------------------------------------------------

    def _code_path(self, sc: AwmScenario) -> Path:
        with self._lock:
            if sc.name not in self._code:
                if not sc.server_code:
                    raise ValueError(f"scenario {sc.name!r} has no server code (gen_envs full_code)")
                path = self._code_dir / f"{sc.name}_server.py"
                path.write_text(sc.server_code, encoding="utf-8")
                self._code[sc.name] = path
            return self._code[sc.name]

    def _server(self, name: str) -> McpServer:
        sc = self.scenario(name)
        command = server_command(server_mode(sc.name, sc.server_code), self._code_path(sc))
        spec = ServerSpec(command=command, call_timeout_s=self.call_timeout_s,
                          start_timeout_s=self.start_timeout_s, limits=self.limits)
        return _ListingServer(self, name, spec, EpisodeDbSandbox(self.limits, self.cache.initial(sc)))

    async def _reset(self, name: str, server: McpServer) -> bool:
        import asyncio

        await asyncio.to_thread(copy_db, self.cache.initial(self.scenario(name)), Path(server.workdir) / EPISODE_DB)
        return True

    def snapshot(self, server: McpServer, dest: Path) -> Path:
        """Copy the episode's database out of a leased server's directory (before its reset)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        copy_db(Path(server.workdir) / EPISODE_DB, dest)
        return dest

    def warm(self, scenarios: list[str] | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
        """Start each scenario's server once (pool-bounded), recording its tools/list; the
        last ones stay idle for the first episodes. Scenario -> tools, or the start's McpFault."""
        names = sorted(set(scenarios if scenarios is not None else self.dataset.scenarios))
        return self.pool.warm(names, timeout_s=timeout_s)

    def prefetch(self, scenarios: list[str]):
        """Start servers for upcoming episodes (a scenario once per episode) in the background
        (KeyedPool.prefetch); returns its future at once."""
        return self.pool.prefetch(list(scenarios))

    def evidence(self, scenarios: list[str]) -> dict[str, dict[str, str]]:
        """Matcher evidence (paper A.3) per scope "awm/<scenario>": each listed tool's description
        and input schema with the implementing function's source. Warms the pool for scenarios
        whose tools were not listed yet; a scenario whose server does not start has none (its
        judged pairs are then unavailable, never guessed)."""
        missing = [s for s in set(scenarios) if s not in self.tools]
        if missing:
            self.warm(missing)
        out = {}
        for name in sorted(set(scenarios)):
            sources = tool_sources(self.scenario(name).server_code)
            out[f"awm/{name}"] = {t["function"]["name"]: tool_evidence(t, sources.get(t["function"]["name"]))
                                  for t in self.tools.get(name, [])}
        return out

    def close(self) -> None:
        if self._fork_pool is not None:
            self._fork_pool.close()
        if self._pool is not None:
            self._pool.close()
        shutil.rmtree(self._code_dir, ignore_errors=True)

    def __enter__(self) -> "AwmRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ListingServer(McpServer):
    """An AWM server that records its scenario's tool list in the runtime once started."""

    def __init__(self, runtime: AwmRuntime, scenario: str, spec: ServerSpec, sandbox: Sandbox):
        super().__init__(spec, sandbox)
        self._runtime, self._scenario = runtime, scenario

    async def start(self) -> "McpServer":
        await super().start()
        self._runtime.tools.setdefault(self._scenario, list(self.tools))
        return self
