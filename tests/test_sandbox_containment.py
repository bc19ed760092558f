"""Containment of environment code (issue 34): a sandboxed server or verifier sees no host file
but the system's, the interpreter's and its own, so neither a canary in the trainer's HOME nor
a 0600 file of the trainer's elsewhere can be read; a tool's forked child and daemon are gone
once the next episode's reset is done; a server that exits during a call is reported as such."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from actionopd_jax.envs.mcp.client import McpFault, ServerSpec
from actionopd_jax.envs.mcp.env import McpEnv
from actionopd_jax.envs.mcp.pool import McpPool
from actionopd_jax.envs.sandbox import SubprocessSandbox
from actionopd_jax.types import Task, ToolCall

NOTES = str(Path(__file__).parent / "data" / "mcp" / "notes_server.py")
TASK = Task(task_id="t0", env="mcp", payload={"prompt": "Store a note, then list them."})


@pytest.fixture
def host_secrets(monkeypatch):
    """A canary in a temporary HOME of the trainer's, and a 0600 file of the trainer's in a
    directory of its own (outside every path the sandbox is given)."""
    with tempfile.TemporaryDirectory(prefix="home-") as home, tempfile.TemporaryDirectory(prefix="secret-") as d:
        canary = Path(home) / ".hostile_canary_home"
        canary.write_text("home-canary")
        secret = Path(d) / "token.txt"
        secret.write_text("private-0600")
        secret.chmod(0o600)
        monkeypatch.setenv("HOME", home)
        assert canary.read_text() == "home-canary" and secret.read_text() == "private-0600"  # the trainer can
        yield canary, secret


def marked(mark: str) -> dict[int, str]:
    """Host pid -> state letter of every process whose environment carries `mark`."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if mark.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    out[int(entry)] = stat[stat.rindex(")") + 2]
            except OSError:
                pass
    return out


def test_a_verifier_cannot_read_home_or_a_private_file(host_secrets, tmp_path):
    canary, secret = host_secrets
    given = tmp_path / "given.txt"
    given.write_text("shared")
    code = ("def f(paths):\n    out = []\n    for p in paths:\n        try:\n            out.append(open(p).read())\n"
            "        except OSError as e:\n            out.append(type(e).__name__)\n    return out\n")
    res = SubprocessSandbox().run_function(code, "f", {"paths": [str(canary), str(secret), str(given)]},
                                           read_paths=(str(tmp_path),))
    assert res.ok, res.error
    # HOME and the private file are not in its view at all; what it was given reads
    assert res.value == ["FileNotFoundError", "FileNotFoundError", "shared"]


def test_a_server_cannot_read_home_or_a_private_file(host_secrets):
    canary, secret = host_secrets
    with McpPool(ServerSpec(command=(sys.executable, NOTES)), size=1) as pool:
        env = McpEnv(pool)

        async def main():
            await env.reset(TASK)

            async def read(path):
                obs, _ = await env.step(ToolCall("read_file", {"path": path}))
                return obs.messages[-1]["content"]

            assert await read(str(canary)) == "refused: No such file or directory"
            assert await read(str(secret)) == "refused: No such file or directory"
            assert await read(os.path.expanduser("~")) == "refused: No such file or directory"
            assert await read("/etc/shadow") == "refused: No such file or directory"
            assert (await read("/etc/hosts")).startswith("read: ")  # system files stay readable
            assert (await read(NOTES)).startswith("read: ")  # and its own code

        asyncio.run(main())


def test_a_tools_child_and_daemon_are_gone_after_the_next_reset():
    mark = uuid.uuid4().hex
    spec = ServerSpec(command=(sys.executable, NOTES), env=(("ACTIONOPD_TEST_MARK", mark),))
    with McpPool(spec, size=1, reset="tool:reset_db") as pool:
        env = McpEnv(pool)

        async def main():
            await env.reset(TASK)
            server_pids = set(marked(mark))
            assert len(server_pids) == 1  # the server (the launcher and the namespace's init carry no mark)
            obs, _ = await env.step(ToolCall("fork_and_daemon", {}))
            assert obs.messages[-1]["content"] == "forked"
            strays = {p: s for p, s in marked(mark).items() if p not in server_pids}
            assert len(strays) == 2 and all(s != "Z" for s in strays.values())  # a child and a daemon, running
            env.end("completed")  # the episode ends; the pool resets the server for the next one
            await env.reset(TASK)  # a pool of one: this waits for that reset
            now = marked(mark)
            assert {p for p, s in now.items() if s != "Z"} == server_pids  # the same server, reused
            # by pid: the daemon, re-parented to the namespace's init, was reaped (gone); the
            # child is at most a zombie of the server that forked it and never reaps (not running)
            gone = [p for p in strays if p not in now]
            zombies = [p for p in strays if now.get(p) == "Z"]
            assert len(gone) >= 1 and len(gone) + len(zombies) == 2
            assert pool.stats.resets == 1 and pool.stats.discarded == 0

        asyncio.run(main())
