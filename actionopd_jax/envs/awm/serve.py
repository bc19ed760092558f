"""An AWM scenario's generated server, started contained and reached over MCP (stdio, or
streamable HTTP for the published FastAPI form: envs/awm/modes.py).

The scenario's `server_code` (gen_envs `full_code`) is written to a private file and run by
the MCP sandbox (envs/mcp/sandbox.py: namespaces, rlimits, scrubbed environment) with the
database path it reads (`DATABASE_PATH`, as AWM's launcher sets it) and `MCP_TRANSPORT=stdio`.
`server_probe` is the audit's "server starts and lists tools" stage (envs/admission.py).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from actionopd_jax.envs.awm.layout import AwmScenario
from actionopd_jax.types import ToolSchema


def server_spec(scenario: AwmScenario, db_path: Path, code_dir: Path, *, start_timeout_s: float = 60.0):
    """The MCP ServerSpec of one scenario's server over `db_path` (its code written under `code_dir`)."""
    from actionopd_jax.envs.awm.modes import server_command, server_mode
    from actionopd_jax.envs.mcp.client import ServerSpec

    mode = server_mode(scenario.name, scenario.server_code)
    code = Path(code_dir) / f"{scenario.name}_server.py"
    code.write_text(scenario.server_code, encoding="utf-8")
    return ServerSpec(command=server_command(mode, code), start_timeout_s=start_timeout_s,
                      env=(("DATABASE_PATH", f"sqlite:///{db_path}"), ("MCP_TRANSPORT", "stdio")))


def list_tools(scenario: AwmScenario, db_path: Path, *, start_timeout_s: float = 60.0) -> list[ToolSchema]:
    """Start the scenario's server contained, return what tools/list gives, stop it.
    Raises envs.mcp.client.McpFault (with its reason) when it does not start or list."""
    from actionopd_jax.envs.mcp.client import McpServer

    async def probe(spec) -> list[ToolSchema]:
        server = await McpServer(spec).start()
        try:
            return list(server.tools)
        finally:
            await server.close()

    with tempfile.TemporaryDirectory(prefix="awm-server-") as code_dir:
        spec = server_spec(scenario, Path(db_path), Path(code_dir), start_timeout_s=start_timeout_s)
        return asyncio.run(probe(spec))


def server_probe(*, start_timeout_s: float = 60.0):
    """The audit's server stage: `probe(scenario, initial_db_path) -> tool schemas`."""
    return lambda scenario, db_path: list_tools(scenario, db_path, start_timeout_s=start_timeout_s)
