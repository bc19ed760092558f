"""Serve a published AWM scenario (a plain FastAPI app, gen_envs `full_code`) as an MCP server
over streamable HTTP: run as `python fastapi_host.py CODE_PATH fd=N` (serve on the listening
socket N the MCP client passed, so the server needs no network of its own) or `CODE_PATH PORT`
(bind 127.0.0.1:PORT itself) inside the MCP sandbox.

What AWM's own launcher gets from `fastapi-mcp` we do here with the MCP SDK the project pins
(fastapi-mcp 0.4 is written against the 1.x SDK's server API and does not start under 2.x,
docs/decisions_collect.md): every FastAPI operation with an `operation_id` is one tool, its input schema
the operation's path / query parameters plus the properties of its JSON body; a call is sent to
the app in-process (httpx's ASGI transport: no second socket) and the reply's text is the tool
result, `isError` when the HTTP status is 4xx / 5xx.

The scenario's module runs under its own name (not `__main__`, so its `uvicorn.run` block does
not), with `DATABASE_PATH` set by the runtime; a `create_engine` on any other SQLite URL is
pointed at `DATABASE_PATH` too, as AWM's launcher rewrites that line. Imported by nothing.
"""

import asyncio
import json
import os
import sys
import types

HTTP_METHODS = ("get", "post", "put", "patch", "delete")


def _redirect_engines(db_url: str) -> None:
    import sqlalchemy

    real = sqlalchemy.create_engine

    def create_engine(url, *args, **kwargs):
        if str(url).startswith("sqlite"):
            url = db_url
        return real(url, *args, **kwargs)

    sqlalchemy.create_engine = create_engine


def load_app(code_path: str):
    """Execute the scenario file as module `awm_scenario`; its FastAPI app (`app`, else the
    first FastAPI instance at module level)."""
    from fastapi import FastAPI

    module = types.ModuleType("awm_scenario")
    module.__file__ = code_path
    sys.modules["awm_scenario"] = module  # pydantic resolves the models' annotations through it
    with open(code_path, encoding="utf-8") as f:
        exec(compile(f.read(), code_path, "exec"), module.__dict__)
    found = module.__dict__.get("app")
    if not isinstance(found, FastAPI):
        found = next((v for v in module.__dict__.values() if isinstance(v, FastAPI)), None)
    if found is None:
        raise SystemExit(f"{code_path}: no FastAPI app at module level")
    return found


def _resolve(node, spec: dict, depth: int = 0):
    """`node` with every `#/components/...` $ref replaced by what it names (depth-bounded)."""
    if depth > 20:
        return {}
    if isinstance(node, list):
        return [_resolve(x, spec, depth + 1) for x in node]
    if not isinstance(node, dict):
        return node
    if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/"):
        target = spec
        for part in node["$ref"][2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return _resolve(target, spec, depth + 1)
    return {k: _resolve(v, spec, depth + 1) for k, v in node.items()}


def openapi_tools(spec: dict) -> dict[str, dict]:
    """Tool name -> {method, path, params: {name: "path"|"query"}, body: None | "object" (its
    properties are arguments) | "value" (the argument `body`), schema: the MCP tool}."""
    tools = {}
    for path, ops in spec.get("paths", {}).items():
        for method, op in ops.items():
            if method not in HTTP_METHODS or not op.get("operationId"):
                continue
            props, required, params = {}, [], {}
            for p in _resolve(op.get("parameters", []), spec):
                if p.get("in") not in ("path", "query"):
                    continue
                schema = dict(p.get("schema", {}))
                if p.get("description"):
                    schema.setdefault("description", p["description"])
                props[p["name"]], params[p["name"]] = schema, p["in"]
                if p.get("required"):
                    required.append(p["name"])
            body = _resolve(op.get("requestBody", {}), spec)
            body_schema = body.get("content", {}).get("application/json", {}).get("schema")
            kind = None
            if body_schema is not None:
                kind = "object" if body_schema.get("type") == "object" or "properties" in body_schema else "value"
                if kind == "object":
                    props.update(body_schema.get("properties", {}))
                    required += [r for r in body_schema.get("required", []) if r not in required]
                else:  # a body that is not an object: one argument named `body`
                    props["body"] = body_schema
                    if body.get("required"):
                        required.append("body")
            text = " ".join(x for x in (op.get("summary"), op.get("description")) if x) or op["operationId"]
            tools[op["operationId"]] = {
                "method": method.upper(), "path": path, "params": params, "body": kind,
                "schema": {"name": op["operationId"], "description": text,
                           "inputSchema": {"type": "object", "properties": props, "required": required}}}
    return tools


async def call_operation(client, tool: dict, arguments: dict) -> tuple[str, bool]:
    """Send one tool call to the app; (reply text, is_error)."""
    path, query, body = tool["path"], {}, {}
    for name, value in (arguments or {}).items():
        where = tool["params"].get(name)
        if where == "path":
            path = path.replace("{" + name + "}", str(value))
        elif where == "query":
            query[name] = value
        else:
            body[name] = value
    if tool["body"] == "value":
        body = body.get("body")
    reply = await client.request(tool["method"], path, params=query or None,
                                 json=body if tool["body"] else None)
    return reply.text, reply.status_code >= 400


def mcp_app(app):
    """The streamable-HTTP MCP app (at /mcp) whose tools are `app`'s operations."""
    import httpx
    import mcp.types as mt
    from mcp.server.lowlevel import Server

    tools = openapi_tools(app.openapi())
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://scenario", timeout=None)

    async def list_tools(ctx, params):
        return mt.ListToolsResult(tools=[mt.Tool(**t["schema"]) for t in tools.values()])

    async def call_tool(ctx, params):
        tool = tools.get(params.name)
        if tool is None:
            return mt.CallToolResult(content=[mt.TextContent(type="text", text=f"unknown tool {params.name!r}")],
                                     is_error=True)
        text, failed = await call_operation(client, tool, dict(params.arguments or {}))
        return mt.CallToolResult(content=[mt.TextContent(type="text", text=text)], is_error=failed)

    server = Server(app.title or "awm", on_list_tools=list_tools, on_call_tool=call_tool)
    return server.streamable_http_app(host="127.0.0.1")


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit("usage: fastapi_host.py CODE_PATH (fd=N | PORT)")
    db_url = os.environ.get("DATABASE_PATH")
    if not db_url:
        raise SystemExit("DATABASE_PATH is not set (the runtime sets it to the episode database)")
    _redirect_engines(db_url)
    app = load_app(argv[1])
    import socket

    import uvicorn

    where = argv[2]
    port = 0 if where.startswith("fd=") else int(where)
    config = uvicorn.Config(mcp_app(app), host="127.0.0.1", port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    if where.startswith("fd="):
        server.run(sockets=[socket.socket(fileno=int(where[3:]))])  # family read from the descriptor
    else:
        server.run()


if __name__ == "__main__":
    main(sys.argv)
