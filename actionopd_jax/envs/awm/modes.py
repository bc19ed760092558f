"""Which way a scenario's generated server is run, read from its code (`ast`, nothing runs).

- "stdio": the code imports the `mcp` SDK itself (our mini pool's servers): run as is, MCP over
  stdio (`MCP_TRANSPORT=stdio`).
- "fastapi": the code defines a FastAPI app at module level and imports no `mcp` (the published
  AWM form): run by `fastapi_host.py`, MCP over streamable HTTP on a free 127.0.0.1 port (a socket the client passes it).
Anything else is refused with the reason (docs/formats.md, "Generated server").
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from actionopd_jax import pyast
from actionopd_jax.envs.mcp.imports import tree_imports

HOST = Path(__file__).with_name("fastapi_host.py")


def _defines_fastapi_app(tree: ast.Module) -> bool:
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Call):
            f = value.func
            if (isinstance(f, ast.Name) and f.id == "FastAPI") or (isinstance(f, ast.Attribute) and f.attr == "FastAPI"):
                return True
    return False


def server_mode(name: str, code: str | None) -> str:
    """"stdio" or "fastapi" for scenario `name`'s server code; ValueError saying why neither."""
    if not code:
        raise ValueError(f"scenario {name!r} has no server code (gen_envs full_code)")
    try:
        tree = pyast.parse(code)
    except SyntaxError as err:
        raise ValueError(f"scenario {name!r}: its server code does not parse ({err})") from None
    imported = tree_imports(tree)
    if "mcp" in imported:
        return "stdio"
    if "fastapi" in imported and _defines_fastapi_app(tree):
        return "fastapi"
    raise ValueError(f"scenario {name!r}: its server code neither imports the mcp SDK (an MCP stdio server) "
                     "nor defines a module-level FastAPI app (the published AWM form); fix its full_code")


def server_command(mode: str, code_path: Path) -> tuple[str, ...]:
    """The command the MCP client starts ("{fd}": the loopback socket it listens on and passes,
    so the server keeps the sandbox's private network namespace)."""
    if mode == "fastapi":
        return (sys.executable, str(HOST), str(code_path), "fd={fd}")
    return (sys.executable, str(code_path))
