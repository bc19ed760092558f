"""An AWM scenario's generated server, started contained and reached over MCP (stdio, or
streamable HTTP for the published FastAPI form: envs/awm/modes.py).

The scenario's `server_code` (gen_envs `full_code`) is written to a private file and run by
the MCP sandbox (envs/mcp/sandbox.py: namespaces, rlimits, scrubbed environment) with the
database path it reads (`DATABASE_PATH`, as AWM's launcher sets it) and `MCP_TRANSPORT=stdio`.
That database is always a copy of the task's own initial database in the server's private,
writable directory (`EpisodeDbSandbox`), made before the server starts: published servers
open it at import (`Base.metadata.create_all`), and the host's database cache is not in the
sandbox's view at all (issue 46 item 9).
`server_probe` is the audit's "server starts and lists tools" stage (envs/admission.py).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from actionopd_jax.envs.awm.layout import AwmScenario
from actionopd_jax.envs.mcp.sandbox import Limits, Sandbox
from actionopd_jax.envs.scratch import scratch_dir
from actionopd_jax.types import ToolSchema

EPISODE_DB = "episode.db"


class EpisodeDbSandbox(Sandbox):
    """The MCP sandbox, whose fresh private directory gets a read-write copy of the scenario's
    initial database before the server starts (a server may open it at import), named in
    DATABASE_PATH. The cached file itself stays outside the server's view."""

    def __init__(self, limits: Limits, initial_db: Path):
        super().__init__(limits, extra_env={"MCP_TRANSPORT": "stdio"})
        self.initial_db = Path(initial_db)

    def new_workdir(self) -> Path:
        workdir = super().new_workdir()
        db = workdir / EPISODE_DB
        shutil.copyfile(self.initial_db, db)
        db.chmod(0o644)  # the cache's file is 0444: the copy is the episode's to write
        self.extra_env["DATABASE_PATH"] = f"sqlite:///{db}"
        return workdir


def server_spec(scenario: AwmScenario, code_dir: Path, *, start_timeout_s: float = 60.0,
                limits: Limits | None = None):
    """The MCP ServerSpec of one scenario's server (its code written under `code_dir`); its
    database comes from the sandbox (`EpisodeDbSandbox`)."""
    from actionopd_jax.envs.awm.modes import server_command, server_mode
    from actionopd_jax.envs.mcp.client import ServerSpec

    mode = server_mode(scenario.name, scenario.server_code)
    code = Path(code_dir) / f"{scenario.name}_server.py"
    code.write_text(scenario.server_code, encoding="utf-8")
    return ServerSpec(command=server_command(mode, code), start_timeout_s=start_timeout_s, limits=limits or Limits())


def list_tools(scenario: AwmScenario, db_path: Path, *, start_timeout_s: float = 60.0) -> list[ToolSchema]:
    """Start the scenario's server contained over a private copy of `db_path` (its initial
    database), return what tools/list gives, stop it.
    Raises envs.mcp.client.McpFault (with its reason) when it does not start or list."""
    from actionopd_jax.envs.mcp.client import McpServer

    async def probe(spec) -> list[ToolSchema]:
        server = await McpServer(spec, EpisodeDbSandbox(spec.limits, Path(db_path))).start()
        try:
            return list(server.tools)
        finally:
            await server.close()

    with tempfile.TemporaryDirectory(prefix="awm-server-", dir=scratch_dir()) as code_dir:
        spec = server_spec(scenario, Path(code_dir), start_timeout_s=start_timeout_s)
        return asyncio.run(probe(spec))


def server_probe(*, start_timeout_s: float = 60.0):
    """The audit's server stage: `probe(scenario, initial_db_path) -> tool schemas`."""
    return lambda scenario, db_path: list_tools(scenario, db_path, start_timeout_s=start_timeout_s)
