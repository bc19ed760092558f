"""A tiny MCP server for the tests and the benchmark: notes in a SQLite file in its working
directory (state persists within an episode; `reset_db` or deleting the file resets it), plus
tools that misbehave on purpose (hang, die, send garbage, look for secrets, write outside,
fork, daemonize, read host files, flood stdout/stderr). Run: python notes_server.py [--http PORT]."""

import os
import sqlite3
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("notes")
DB = "state.db"


def _db() -> sqlite3.Connection:
    conn = sqlite3.connect(DB)
    conn.execute("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL)")
    return conn


@server.tool()
def add_note(text: str) -> str:
    """Store a note; returns its id."""
    with _db() as conn:
        cur = conn.execute("INSERT INTO notes (text) VALUES (?)", (text,))
    return f"note {cur.lastrowid} stored"


@server.tool()
def list_notes() -> list[str]:
    """Every stored note, oldest first."""
    with _db() as conn:
        return [r[0] for r in conn.execute("SELECT text FROM notes ORDER BY id")]


@server.tool(name="count-notes")
def count_notes(prefix: str = "") -> int:
    """How many notes start with `prefix` (a tool name with a hyphen, as MCP allows)."""
    with _db() as conn:
        return conn.execute("SELECT COUNT(*) FROM notes WHERE text LIKE ?", (prefix + "%",)).fetchone()[0]


@server.tool()
def reset_db() -> str:
    """Drop every note."""
    with _db() as conn:
        conn.execute("DELETE FROM notes")
    return "reset"


@server.tool()
def fail(message: str) -> str:
    """Always fails with `message` (an isError result)."""
    raise ValueError(message)


@server.tool()
def sleep(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def crash() -> str:
    """Exit the server at once."""
    os._exit(3)


@server.tool()
def garbage() -> str:
    """Write a line that is not JSON-RPC onto the protocol stream."""
    os.write(1, b"this is not json\n")
    time.sleep(30)
    return "unreachable"


@server.tool()
def read_env(name: str) -> str:
    """The value of an environment variable ('' if unset) and how many variables exist."""
    return f"{os.environ.get(name, '')}|{len(os.environ)}|{os.environ.get('ACTIONOPD_SANDBOX', '')}"


@server.tool()
def limits() -> dict[str, int]:
    """This process's resource limits (soft values)."""
    import resource
    return {name: resource.getrlimit(getattr(resource, name))[0]
            for name in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NOFILE")}


@server.tool()
def write_file(path: str) -> str:
    """Try to write `path`; says what happened."""
    try:
        with open(path, "w") as f:
            f.write("x")
        return "written"
    except OSError as err:
        return f"refused: {err.strerror}"


@server.tool()
def fork_sleepers(count: int) -> str:
    """Fork `count` children that leave the process group and sleep for an hour."""
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            os.setsid()
            time.sleep(3600)
            os._exit(0)
        pids.append(pid)
    return " ".join(map(str, pids))


@server.tool()
def read_file(path: str) -> str:
    """Try to read `path`; its text or what happened."""
    try:
        with open(path) as f:
            return "read: " + f.read()
    except OSError as err:
        return f"refused: {err.strerror}"


@server.tool()
def fork_and_daemon() -> str:
    """Fork a child that sleeps, and a daemon (double fork + setsid) that sleeps: both would
    outlive the episode unless the reset ends them."""
    child = os.fork()
    if child == 0:
        time.sleep(3600)
        os._exit(0)
    r, w = os.pipe()
    first = os.fork()
    if first == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(w, b"ready")
            time.sleep(3600)
        os._exit(0)
    os.waitpid(first, 0)
    os.read(r, 5)  # the daemon runs before the tool answers
    os.close(r)
    os.close(w)
    return "forked"


@server.tool()
def flood(megabytes: int, stream: str) -> str:
    """Write `megabytes` MB without a newline to stdout or stderr."""
    chunk = b"x" * (1 << 20)
    fd = 1 if stream == "stdout" else 2
    for _ in range(megabytes):
        os.write(fd, chunk)
    return "flooded"


@server.tool()
def connect(host: str, port: int) -> str:
    """Try a TCP connection; says what happened."""
    import socket
    try:
        socket.create_connection((host, port), timeout=2).close()
        return "connected"
    except OSError as err:
        return f"refused: {err}"


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
