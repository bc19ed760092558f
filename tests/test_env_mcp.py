"""MCP tool servers as environments (actionopd_jax/envs/mcp): real sandboxed subprocess servers
over the real MCP SDK, stdio and streamable HTTP; state within / across episodes; faults end
the episode with a reason while other episodes go on; containment of a hostile server."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from actionopd_jax.config import EnvConfig
from actionopd_jax.envs.mcp.client import McpFault, ServerSpec
from actionopd_jax.envs.mcp.env import McpEnv
from actionopd_jax.envs.mcp.pool import McpPool
from actionopd_jax.envs.mcp.sandbox import Limits, Sandbox
from actionopd_jax.envs.registry import env_factory_from
from actionopd_jax.envs.task_sets import training_task_sets
from actionopd_jax.types import Message, Task, ToolCall

DATA = Path(__file__).parent / "data" / "mcp"
NOTES = str(DATA / "notes_server.py")
RAW = str(DATA / "raw_server.py")
EMPTY = "{\"result\": []}"  # no text blocks: the structured content, as JSON
TASK = Task(task_id="t0", env="mcp", payload={"prompt": "Store a note, then list them."})


def marked_pids(mark: str) -> list[int]:
    """Every live process whose environment carries `mark` (a server and anything it forked)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if mark.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    status = Path(f"/proc/{entry}/status").read_text()
                    if "State:\tZ" not in status:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def wait_gone(mark: str, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := marked_pids(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def spec(*args, mark: str = "", **kw) -> ServerSpec:
    env = (("ACTIONOPD_TEST_MARK", mark),) if mark else ()
    return ServerSpec(command=(sys.executable, *args), env=env, **kw)


async def episode(env: McpEnv, calls: list[tuple[str, dict]]) -> list[str]:
    """Run `calls` as one episode, then answer; the tool messages' texts."""
    obs = await env.reset(TASK)
    for name, args in calls:
        obs, done = await env.step(ToolCall(name, args))
        assert not done
    obs, done = await env.step(Message("done"))
    assert done and env.score()["end_reason"] == "completed"
    return [m["content"] for m in obs.messages if m["role"] == "tool"]


def test_tools_listed_calls_run_state_persists_and_resets_stdio():
    mark = uuid.uuid4().hex
    with McpPool(spec(NOTES, mark=mark), size=1, reset="tool:reset_db") as pool:
        env = McpEnv(pool)

        async def main():
            obs = await env.reset(TASK)
            names = [t["function"]["name"] for t in obs.tools]
            assert "add_note" in names and "reset_db" not in names  # the reset hook is not offered
            add = next(t for t in obs.tools if t["function"]["name"] == "add_note")["function"]
            assert add["description"] == "Store a note; returns its id."
            assert add["parameters"]["properties"]["text"]["type"] == "string"
            assert add["parameters"]["required"] == ["text"]
            obs, _ = await env.step(ToolCall("add_note", {"text": "alpha"}))
            obs, _ = await env.step(ToolCall("add_note", {"text": "beta"}))
            obs, _ = await env.step(ToolCall("list_notes", {}))
            assert obs.messages[-1]["content"] == "alpha\nbeta"  # state within the episode
            obs, _ = await env.step(ToolCall("fail", {"message": "no"}))
            assert obs.messages[-1]["content"].startswith("Error")  # isError -> an error message
            obs, _ = await env.step(ToolCall("no_such_tool", {}))
            assert "no_such_tool" in obs.messages[-1]["content"]  # refused before the server
            obs, _ = await env.step(ToolCall("count-notes", {"prefix": "al"}))
            assert obs.messages[-1]["content"] == "1"  # MCP names may hold '-'
            obs, _ = await env.step(ToolCall("count-notes", {"bogus": 1}))
            assert "unknown parameter 'bogus' for 'count-notes'" in obs.messages[-1]["content"]
            await env.step(Message("ok"))
            assert env.score()["tool_errors"] == 3
            # the next episode reuses the server, reset by the tool
            assert await episode(env, [("list_notes", {})]) == [EMPTY]

        asyncio.run(main())
        assert pool.stats.starts == 1 and pool.stats.resets >= 1
        evidence = pool.evidence({"add_note": "def add_note(text): ..."})
        assert "Store a note; returns its id." in evidence["add_note"] and '"text"' in evidence["add_note"]
        assert "def add_note(text)" in evidence["add_note"] and "implementation" not in evidence["list_notes"]
        assert pool.stats.starts == 1  # read from the live server
    assert wait_gone(mark) == []


def test_secrets_are_refused_and_the_collector_records_the_servers_reason():
    with pytest.raises(ValueError, match="secret"):
        Sandbox(extra_env={"OPENAI_API_KEY": "sk-x"})
    from types import SimpleNamespace

    from actionopd_jax.collect.collector import Collector
    from actionopd_jax.collect.env_calls import EnvFailure
    from actionopd_jax.collect.metrics import TrajectoryRecord

    async def failing():
        raise McpFault("mcp_timeout", "tools/call sleep exceeded 1s")

    rec = TrajectoryRecord(task_start=0, task_id="t", env="mcp")
    with pytest.raises(EnvFailure) as err:
        asyncio.run(Collector._env_call(SimpleNamespace(cfg=SimpleNamespace(env_timeout_s=5)), failing(), rec))
    assert err.value.reason == "mcp_timeout"


def test_http_server_with_command_reset_through_the_config_factory(tmp_path):
    mark = uuid.uuid4().hex
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(r) for r in [
        {"task_id": "a", "prompt": "add a note"}, {"task_id": "b", "prompt": "list", "split": "test"}]))
    cfg = EnvConfig(name="mcp", mcp_command=(sys.executable, NOTES, "--http", "{port}"), tasks_file=str(tasks),
                    mcp_reset="command:rm -f state.db", mcp_pool_size=1)
    (name, loaded), = training_task_sets(cfg, needed_by="test")
    assert [t.task_id for t in loaded] == ["a"] and loaded[0].payload == {"prompt": "add a note"}
    make = env_factory_from(cfg)
    pool = make.pool
    pool.spec = ServerSpec(command=pool.spec.command, env=(("ACTIONOPD_TEST_MARK", mark),))
    try:
        async def main():
            assert await episode(make(loaded[0]), [("add_note", {"text": "x"}), ("list_notes", {})]) \
                == ["note 1 stored", "x"]
            assert await episode(make(loaded[0]), [("list_notes", {})]) == [EMPTY]  # the file was removed

        asyncio.run(main())
        assert pool.stats.starts == 1 and pool.stats.resets >= 1  # the last release may still run
    finally:
        pool.close()
    assert wait_gone(mark) == []


def test_a_server_that_cannot_start_ends_the_episode_with_a_reason():
    with McpPool(ServerSpec(command=(sys.executable, "-c", "raise SystemExit(2)")), size=1) as pool:
        env = McpEnv(pool)
        with pytest.raises(McpFault) as err:
            asyncio.run(env.reset(TASK))
        assert err.value.end_reason == "mcp_start_failed" and "2" in err.value.detail
        env.end("env_error")
        assert env.score()["end_reason"] == "mcp_start_failed"


def test_an_existing_http_server_by_url(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, NOTES, "--http", str(port)], stderr=subprocess.DEVNULL,
                              start_new_session=True, cwd=tmp_path)  # its state.db goes there
    try:
        deadline = time.monotonic() + 30
        while socket.socket().connect_ex(("127.0.0.1", port)) and time.monotonic() < deadline:
            time.sleep(0.05)
        # one shared database behind the url: one episode at a time
        with McpPool(ServerSpec(url=f"http://127.0.0.1:{port}/mcp"), size=1, reset="tool:reset_db") as pool:
            env = McpEnv(pool)

            async def main():
                assert await episode(env, [("add_note", {"text": "u"}), ("list_notes", {})]) == ["note 1 stored", "u"]
                assert await episode(env, [("list_notes", {})]) == [EMPTY]

            asyncio.run(main())
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("tool,args,reason", [
    ("crash", {}, "mcp_connection_lost"),
    ("sleep", {"seconds": 60}, "mcp_timeout"),
])
def test_a_fault_ends_its_episode_with_a_reason_and_others_go_on(tool, args, reason):
    mark = uuid.uuid4().hex
    # a call limit far from both outcomes: the sleep's 60 s against 5 s, and the healthy episode's
    # quick calls against the same 5 s on a loaded host; the crash needs no limit (60 s)
    limit = 5.0 if tool == "sleep" else 60.0
    with McpPool(spec(NOTES, mark=mark, call_timeout_s=limit), size=2, reset="tool:reset_db") as pool:
        broken, healthy = McpEnv(pool), McpEnv(pool)

        async def main():
            await broken.reset(TASK)
            await healthy.reset(TASK)
            await healthy.step(ToolCall("add_note", {"text": "kept"}))
            with pytest.raises(McpFault) as err:
                await broken.step(ToolCall(tool, args))
            assert err.value.end_reason == reason
            score = broken.score()
            assert score["end_reason"] == reason and score["fault"]
            obs, _ = await healthy.step(ToolCall("list_notes", {}))  # the other episode goes on
            assert obs.messages[-1]["content"] == "kept"
            await healthy.step(Message("ok"))
            healthy.score()
            assert await episode(broken, [("list_notes", {})]) == [EMPTY]  # a new episode works

        asyncio.run(main())
        assert pool.stats.discarded == 1 and len(marked_pids(mark)) <= 2
    assert wait_gone(mark) == []


@pytest.mark.parametrize("http", [False, True])
def test_a_server_that_exits_during_a_call_is_reported_with_its_code(http):
    # the tool calls os._exit(3): over HTTP the SDK first sees its SSE stream end; the fault
    # must still say that the server exited, and with which code (issue 34)
    args = (NOTES, "--http", "{port}") if http else (NOTES,)
    with McpPool(spec(*args, call_timeout_s=30), size=1) as pool:
        env = McpEnv(pool)

        async def main():
            await env.reset(TASK)
            with pytest.raises(McpFault) as err:
                await env.step(ToolCall("crash", {}))
            assert err.value.end_reason == "mcp_connection_lost"
            assert err.value.detail.startswith("the server exited with code 3 during tools/call crash")

        asyncio.run(main())


@pytest.mark.parametrize("mode,words", [("garbage", "non-MCP line"), ("badresult", "CallToolResult"),
                                        ("flood", "size limit")])
def test_a_malformed_reply_is_a_protocol_error(mode, words):
    # the call timeout (60 s) would end it as mcp_timeout: only detection gives mcp_protocol_error
    with McpPool(ServerSpec(command=(sys.executable, RAW, mode), call_timeout_s=60), size=1) as pool:
        env = McpEnv(pool)

        async def main():
            await env.reset(TASK)
            with pytest.raises(McpFault) as err:
                await env.step(ToolCall("echo", {}))
            # detected as what it is, not the call timeout's mcp_timeout (no duration asserted)
            assert err.value.end_reason == "mcp_protocol_error" and words in err.value.detail
            assert (await env.reset(TASK)).tools  # a fresh server for the next episode

        asyncio.run(main())


def test_a_hostile_server_is_contained(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-for-servers")
    monkeypatch.setenv("HF_TOKEN", "hf-test-not-for-servers")
    mark = uuid.uuid4().hex
    outside = tmp_path / "outside.txt"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    limits = Limits(file_mb=16, max_line_bytes=1 << 20)
    # 6 s: the sandboxed calls (forking sleepers among them) answer well within it on a loaded
    # host, and the 30 s sleep is cut by it
    with McpPool(spec(NOTES, mark=mark, call_timeout_s=6, limits=limits), size=2) as pool:
        env = McpEnv(pool)

        async def call(name, args):
            obs, _ = await env.step(ToolCall(name, args))
            return obs.messages[-1]["content"]

        async def main():
            await env.reset(TASK)
            assert (await call("read_env", {"name": "OPENAI_API_KEY"})).startswith("|")
            assert (await call("read_env", {"name": "HF_TOKEN"})).startswith("|")
            sandbox = (await call("read_env", {"name": "HOME"})).split("|")
            assert sandbox[0].startswith("/") and "actionopd-mcp-" in sandbox[0]  # its own HOME
            assert "pidns=on" in sandbox[2] and "mountns=on(private root)" in sandbox[2]
            assert "netns=on(loopback only)" in sandbox[2]
            got = json.loads(await call("limits", {}))
            assert got == limits.rlimits()  # CPU, address space, file size, open files
            assert (await call("write_file", {"path": str(outside)})).startswith("refused")
            assert not outside.exists()
            assert await call("write_file", {"path": "inside.txt"}) == "written"
            assert (await call("connect", {"host": "127.0.0.1", "port": port})).startswith("refused")
            assert len((await call("fork_sleepers", {"count": 3})).split()) == 3
            assert len(marked_pids(mark)) >= 4  # the server and three sleepers (the launcher has no env)
            with pytest.raises(McpFault) as err:  # the sleep is cut by the wall-clock limit
                await call("sleep", {"seconds": 30})
            assert err.value.end_reason == "mcp_timeout"
            # the forked sleepers died with the server's pid namespace
            assert wait_gone(mark, timeout=5) == []

        asyncio.run(main())
    # 100 MB to stderr: its log file stops at RLIMIT_FSIZE (Python ignores SIGXFSZ, so the write
    # fails with EFBIG and the tool reports an error); the SDK server keeps fd 1 off the protocol
    # stream (the raw server floods that one: test above). A pool of its own with a call limit
    # a loaded CI machine cannot reach: 16 MB written there once took over 3 s.
    with McpPool(spec(NOTES, mark=mark, call_timeout_s=120, limits=limits), size=1) as pool:
        env = McpEnv(pool)

        async def flood():
            await env.reset(TASK)
            obs, _ = await env.step(ToolCall("flood", {"megabytes": 100, "stream": "stderr"}))
            assert obs.messages[-1]["content"].startswith("Error")
            assert env._server.proc.stderr_path.stat().st_size <= 16 << 20

        asyncio.run(flood())
    listener.close()
    assert wait_gone(mark) == []


KILLED_PARENT = """
import asyncio, sys, time
sys.path.insert(0, {root!r})
from actionopd_jax.envs.mcp.client import ServerSpec
from actionopd_jax.envs.mcp.pool import McpPool
pool = McpPool(ServerSpec(command=(sys.executable, {notes!r}), env=(("ACTIONOPD_TEST_MARK", {mark!r}),)), size=2)
async def main():
    a = await pool.acquire(); b = await pool.acquire()
    await pool.loop.run(a.call("fork_sleepers", {{"count": 2}}))
asyncio.run(main())
print("READY", flush=True)
time.sleep(600)
"""


def test_no_server_outlives_a_kill_9_of_its_parent(tmp_path):
    mark = uuid.uuid4().hex
    code = KILLED_PARENT.format(root=str(Path(__file__).parents[1]), notes=NOTES, mark=mark)
    # the private directories a kill -9 cannot remove go under tmp_path (TMPDIR)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        assert parent.stdout.readline().strip() == "READY"
        assert len(marked_pids(mark)) >= 4  # 2 servers + 2 sleepers
        parent.kill()
        parent.wait(10)
        assert wait_gone(mark) == []
    finally:
        parent.kill()
