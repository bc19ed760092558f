"""Containment of environment code (issue 34): a sandboxed server or verifier sees no host file
but the system's, the interpreter's and its own, so neither a canary in the trainer's HOME nor
a 0600 file of the trainer's elsewhere can be read; a tool's forked child and daemon are gone
once the next episode's reset is done; a server that exits during a call is reported as such."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from actionopd_jax.config import EnvConfig
from actionopd_jax.envs.awm.factory import awm_env_factory
from actionopd_jax.envs.awm.layout import load_awm
from actionopd_jax.envs.mcp.client import ServerSpec
from actionopd_jax.envs.mcp.env import McpEnv
from actionopd_jax.envs.mcp.pool import McpPool
from actionopd_jax.envs.sandbox import SubprocessSandbox
from actionopd_jax.types import Message, Task, ToolCall

NOTES = str(Path(__file__).parent / "data" / "mcp" / "notes_server.py")
AWM = Path(__file__).parent / "data" / "awm_mini"
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


FORKING_TOOL = '''

@mcp.tool(name="fork_and_daemon", description="Leave a child and a daemon running.")
def fork_and_daemon() -> dict:
    import time
    if os.fork() == 0:
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
    os.read(r, 5)
    return {"forked": True}
'''


def test_a_pooled_awm_servers_reset_ends_what_its_tools_started(tmp_path):
    # the AWM pool resets a server in place (its database copied back): the processes a tool
    # left must not live on into the next episode (issue 34)
    pool_dir = tmp_path / "awm"
    shutil.copytree(AWM, pool_dir)
    rows = [json.loads(line) for line in (pool_dir / "gen_envs.jsonl").read_text().splitlines()]
    for r in rows:
        r["full_code"] = r["full_code"].replace('\n\nif __name__ == "__main__":', FORKING_TOOL + '\n\nif __name__ == "__main__":')
    (pool_dir / "gen_envs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    make = awm_env_factory(EnvConfig(name="awm", awm_dir=str(pool_dir), mcp_pool_size=1), cache_dir=str(tmp_path / "c"))
    task = {t.task_id: t for t in load_awm(pool_dir).tasks()}["recipe_box_2/0"]
    try:
        async def main():
            env = make(task)
            await env.reset(task)
            server = env._server
            mark = str(server.workdir)  # in DATABASE_PATH: every process of this server carries it
            before = set(marked(mark))
            await env.step(ToolCall("fork_and_daemon", {}))
            strays = set(marked(mark)) - before
            assert len(strays) == 2
            await env.step(Message("Done."))
            await asyncio.to_thread(env.score)  # gives the server back: the pool resets it
            again = make(task)
            await again.reset(task)  # a pool of one: waits for that reset
            assert again._server is server  # reset in place, not replaced
            now = marked(mark)
            assert {p for p, s in now.items() if s != "Z"} == before
            assert all(now.get(p, "Z") == "Z" for p in strays) and any(p not in now for p in strays)

        asyncio.run(main())
    finally:
        make.close()


DRIVER = '''
import asyncio, json, shutil, sys
from actionopd_jax.envs.mcp.sandbox import Sandbox
from actionopd_jax.envs.sandbox import SubprocessSandbox

READ = ("def f(paths):\\n    out = []\\n    for p in paths:\\n        try:\\n            out.append(open(p).read())\\n"
        "        except OSError as e:\\n            out.append(type(e).__name__)\\n    return out\\n")


async def server(script):
    sandbox = Sandbox()
    workdir = sandbox.new_workdir()   # run() leaves a given workdir in place: remove it here
    try:
        return await sandbox.run([sys.executable, script], workdir=workdir, timeout_s=60)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


code, tail = asyncio.run(server(sys.argv[1]))
verifier = SubprocessSandbox().run_function(READ, "f", {"paths": json.loads(sys.argv[2])})
print(json.dumps({"server_exit": code, "server": tail, "verifier": verifier.value, "error": verifier.error}))
'''

SERVER = '''
import json, sys
import probe_helper  # a module of the PYTHONPATH directory: shown to the server alone
out = {"helper": probe_helper.VALUE}
for p in %r:
    try:
        out[p] = open(p).read()
    except OSError as e:
        out[p] = type(e).__name__
sys.stderr.write(json.dumps(out))
'''


def test_a_trainer_started_with_python_m_from_home_shows_neither_home_nor_pythonpath_files(tmp_path):
    """Issue 46 item 11: every directory on the trainer's sys.path / PYTHONPATH used to be
    mounted whole (its 0600 files included), and `python -m ...` started from HOME put HOME on
    sys.path[0]. Started exactly that way, with a 0600 file in HOME and one in a PYTHONPATH
    directory, neither a server nor a verifier can read either; the module the server imports
    from that directory still loads."""
    home, pp, code_dir = tmp_path / "home", tmp_path / "pp", tmp_path / "code"
    for d in (home, pp, code_dir):
        d.mkdir()
    canary, secret = home / "canary.txt", pp / "secret.txt"
    for f, text in ((canary, "home-canary"), (secret, "pythonpath-secret")):
        f.write_text(text)
        f.chmod(0o600)
    (pp / "probe_driver.py").write_text(DRIVER)
    (pp / "probe_helper.py").write_text("VALUE = 'helper loaded'\n")
    targets = [str(canary), str(secret), str(pp / "probe_driver.py")]
    script = code_dir / "server.py"
    script.write_text(SERVER % (targets,))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HOME")}
    env.update(HOME=str(home), PYTHONPATH=str(pp))
    import subprocess

    run = subprocess.run([sys.executable, "-m", "probe_driver", str(script), json.dumps(targets)], cwd=home, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["server_exit"] == 0, got
    seen = json.loads(got["server"])
    assert seen["helper"] == "helper loaded"  # what the server imports from PYTHONPATH is there
    # HOME, the private file and the rest of the PYTHONPATH directory are not in its view
    assert [seen[t] for t in targets] == ["FileNotFoundError"] * 3
    assert got["verifier"] == ["FileNotFoundError"] * 3, got


def test_only_the_modules_a_command_imports_come_from_pythonpath_followed_transitively(tmp_path, monkeypatch):
    from actionopd_jax.envs.mcp.imports import outside_imports

    pp = tmp_path / "pp"
    (pp / "pkg_a").mkdir(parents=True)
    (pp / "pkg_a" / "__init__.py").write_text("def f():\n    import mod_b\n")
    (pp / "mod_b.py").write_text("import json\n")
    (pp / "unrelated.py").write_text("")
    script = tmp_path / "code" / "server.py"
    script.parent.mkdir()
    script.write_text("import os\ntry:\n    from pkg_a import f\nexcept ImportError:\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", str(pp))
    got = outside_imports([sys.executable, str(script)], [])
    assert sorted(got) == [str(pp / "mod_b.py"), str(pp / "pkg_a")]
    assert outside_imports([sys.executable, "-m", "mod_b"], []) == [str(pp / "mod_b.py")]
    assert outside_imports([sys.executable, "-W", "ignore", "-u", str(script)], []) == got
    assert outside_imports(["/bin/sh", str(script)], []) == []  # not a Python command
