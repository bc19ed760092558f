"""A hand-written stdio JSON-RPC server that speaks just enough MCP to start, then answers
tools/call badly: `garbage` (a non-JSON line), `badresult` (a result that is no tool result)
or `flood` (100 MB without a newline). Run: python raw_server.py garbage|badresult|flood."""

import json
import sys

MODE = sys.argv[1]


def send(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue  # a notification
    method, rid = msg.get("method"), msg["id"]
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": rid, "result": {
            "protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
            "serverInfo": {"name": "raw", "version": "0"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": rid, "result": {"tools": [
            {"name": "echo", "description": "Echo.", "inputSchema": {"type": "object", "properties": {}}}]}})
    elif method == "tools/call" and MODE == "garbage":
        sys.stdout.write("}}} not json at all {{{\n")
        sys.stdout.flush()
    elif method == "tools/call" and MODE == "flood":
        chunk = "x" * (1 << 20)
        for _ in range(100):  # 100 MB, no newline
            sys.stdout.write(chunk)
        sys.stdout.flush()
    elif method == "tools/call":
        send({"jsonrpc": "2.0", "id": rid, "result": {"content": 5}})
    else:
        send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "no such method"}})
