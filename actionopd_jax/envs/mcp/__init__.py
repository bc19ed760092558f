"""Any MCP tool server as an environment (`env.name: mcp`), its server code contained.

sandbox.py + launcher.py: containment (the enforced / not-enforced table is in sandbox.py);
transport.py: a size-bounded stdio transport; client.py: one SDK connection; loop.py: the
event-loop thread that owns connections; pool.py: the bounded, reusing server pool;
convert.py: MCP tools/results <-> our types; env.py: the `Environment`; tasks.py: task files.
"""
