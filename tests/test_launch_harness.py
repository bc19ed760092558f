"""launch/benchmark_harness.py (issue 33 item 8): `actionopd serve` started with table 8's student
evaluation settings as server-side defaults; a harness request that omits sampling fields gets
them, and the reply limit holds whatever max_tokens a request asks. Issue 43 item 8: the
server holds B.3's per-task limits (ToolSandbox: 30 messages; AppWorld: 100k output tokens),
counted per task id (the request's `user` field), and the harness stops the server it started
on SIGTERM, SIGINT and its own death."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from actionopd_jax.launch.harness import APPWORLD, STUDENT_EVAL, TOOLSANDBOX, harness_text, serve_argv
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.requests import ChatChoice
from actionopd_jax.serve.scripted import ScriptedBackend
from actionopd_jax.serve.task_limits import TaskLimitedBackend


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_settings_and_commands_follow_table_8_and_b3():
    argv = serve_argv(["--tiny"], port=8123, model_name="student", reply_limit=STUDENT_EVAL["max_response_tokens"])
    joined = " ".join(argv)
    assert "--enable-thinking" in argv and "--default-temperature 0.0" in joined and "--max-tokens-cap 4096" in joined
    text = harness_text("http://127.0.0.1:8123/v1", "student")
    assert text.startswith("NOT RUN HERE") and "appworld run" in text and "tool_sandbox --agent" in text
    assert (TOOLSANDBOX["scenarios"], TOOLSANDBOX["trials"], TOOLSANDBOX["max_messages"]) == (490, 4, 30)
    assert (APPWORLD["max_steps"], APPWORLD["output_token_budget"]) == (50, 100_000)
    assert '"max_steps": 50' in text and "1,960 trials" in text
    # each benchmark's server holds its B.3 limit and the model's whole context (not serve's 8,192)
    tool = " ".join(serve_argv(["--tiny"], port=1, model_name="s", reply_limit=4096, bench="toolsandbox"))
    app = " ".join(serve_argv(["--tiny"], port=1, model_name="s", reply_limit=4096, bench="appworld"))
    assert "--task-max-messages 30" in tool and "--task-max-output-tokens" not in tool
    assert "--task-max-output-tokens 100000" in app and "--task-max-messages" not in app
    assert "user=" in text and "NOT enforced" not in text
    # serve's engine holds the model's own context unless narrowed (it was a fixed 8,192)
    from actionopd_jax.serve.cli import _parser as serve_parser

    assert "--engine-max-len" not in app and serve_parser().parse_args(["--tiny"]).engine_max_len is None


def test_serve_applies_the_defaults_to_a_request_without_sampling_fields():
    port = _free_port()
    # the script's own serve command, with a 5-token reply limit so the tiny model hits it fast
    argv = serve_argv(["--tiny", "--seed", "1", "--lm-head", "float32"], port=port, model_name="student", reply_limit=5)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 110
        line = ""
        while time.time() < deadline:
            line = proc.stdout.readline()
            if "serving" in line or not line:
                break
        assert f"http://127.0.0.1:{port}/v1" in line, line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0)
        msgs = [{"role": "user", "content": "hello there"}]
        # ToolSandbox-style: no temperature, no max_tokens; greedy means the n=3 samples agree, and
        # they equal an explicit temperature-0 request's reply
        bare = client.chat.completions.create(model="student", messages=msgs, n=3)
        texts = {c.message.content for c in bare.choices}
        greedy = client.chat.completions.create(model="student", messages=msgs, temperature=0, max_tokens=5)
        assert len(texts) == 1 and texts == {greedy.choices[0].message.content}
        # the limit: asking for 100,000 tokens still gets at most 5, cut with finish_reason length
        big = client.chat.completions.create(model="student", messages=msgs, max_tokens=100_000, temperature=0)
        assert big.usage.completion_tokens <= 5 and bare.usage.completion_tokens <= 15
        assert big.choices[0].finish_reason in ("length", "stop")
        # an explicit temperature still wins over the default
        hot = client.chat.completions.create(model="student", messages=msgs, n=8, temperature=1.5, max_tokens=5)
        assert len({c.message.content for c in hot.choices}) > 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _counted_backend():
    """A scripted model whose every reply is `max_tokens` tokens long (at most 64), as a real
    model that never stops early would be: the budget must hold against the worst case."""
    def reply(req):
        return ChatChoice(content="x", finish_reason="length", completion_tokens=min(req.max_tokens or 64, 64))
    return ScriptedBackend("student", reply)


def test_appworld_output_tokens_are_budgeted_per_task_id_over_http():
    """100 output tokens a task (B.3's 100,000, scaled): the replies of one task are cut to what
    it has left, then its requests are refused; another task id has its own budget; a request
    with no task id is refused, saying where the id goes."""
    limited = TaskLimitedBackend(_counted_backend(), max_output_tokens=100)
    with OpenAIServer(limited) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="EMPTY", max_retries=0)
        ask = lambda task, **kw: client.chat.completions.create(
            model="student", messages=[{"role": "user", "content": "go"}], user=task, **kw)
        got = [ask("appworld/a").usage.completion_tokens for _ in range(2)]   # 64, then the 36 left
        assert got == [64, 36] and limited.use["appworld/a"].output_tokens == 100
        with pytest.raises(openai.BadRequestError, match="task_token_budget_exhausted|spent its budget of 100"):
            ask("appworld/a", max_tokens=5)
        assert ask("appworld/b", max_tokens=10).usage.completion_tokens == 10
        assert limited.use["appworld/b"].output_tokens == 10
        with pytest.raises(openai.BadRequestError, match="`user` field"):
            client.chat.completions.create(model="student", messages=[{"role": "user", "content": "go"}])
        # n samples share the task's allowance: 4 x 22 of the 90 left
        both = ask("appworld/b", n=4, max_tokens=1000)
        assert [c for c in both.choices] and limited.use["appworld/b"].output_tokens == 10 + 4 * 22


def test_toolsandbox_messages_are_counted_per_task_id_over_http():
    """30 messages a task (B.3): 29 get a reply (the 30th message); a 30-message conversation is
    refused, and so is a shortened one of the same task once it has had its 30; another task id
    has its own count."""
    limited = TaskLimitedBackend(ScriptedBackend("student", lambda r: ChatChoice(content="ok")), max_messages=30)
    talk = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(30)]
    with OpenAIServer(limited) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="EMPTY", max_retries=0)
        ask = lambda task, n: client.chat.completions.create(model="student", messages=talk[:n], user=task)
        assert ask("toolsandbox/s1/0", 29).choices[0].message.content == "ok"
        for n in (30, 2):
            with pytest.raises(openai.BadRequestError, match="limit of 30 messages.*holds 30"):
                ask("toolsandbox/s1/0", n)
        assert ask("toolsandbox/s1/1", 2).choices[0].message.content == "ok"
    assert limited.use["toolsandbox/s1/0"].messages == 30 and limited.use["toolsandbox/s1/1"].messages == 3


def test_replies_in_flight_hold_their_allowance():
    """Two concurrent requests of one task cannot both take the whole budget."""
    limited = TaskLimitedBackend(_counted_backend(), max_output_tokens=100)
    asked = []

    both_in = []

    async def slow(req):   # each reply ends only once both requests are being generated
        if not both_in:
            both_in.append(asyncio.Event())
        asked.append(req.max_tokens)
        if len(asked) == 2:
            both_in[0].set()
        await asyncio.wait_for(both_in[0].wait(), 30)
        return ChatChoice(content="x", completion_tokens=req.max_tokens)

    limited._backend = ScriptedBackend("student", slow)
    with OpenAIServer(limited) as srv:
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="EMPTY", max_retries=0)

        async def both():
            return await asyncio.gather(*[client.chat.completions.create(
                model="student", messages=[{"role": "user", "content": "go"}], user="t", max_tokens=64)
                for _ in range(2)], return_exceptions=True)

        results = asyncio.run(both())
    assert not [r for r in results if isinstance(r, Exception)], results
    assert sorted(asked) == [36, 64] and limited.use["t"].output_tokens == 100


def _start_harness(port: int, *extra: str, sigint_ignored: bool = False) -> tuple[subprocess.Popen, int]:
    """The harness (a real `actionopd serve` child with the tiny model), once its server is up:
    (harness process, server pid). `sigint_ignored`: start it as nohup or a script's background
    job would, with SIGINT ignored (Python then raises no KeyboardInterrupt of its own)."""
    from tests._subprocess_fixtures import cli_env

    argv = [sys.executable, "launch/benchmark_harness.py", "--tiny", "--port", str(port), "--reply-limit", "5",
            "--serve-arg=--no-warmup", "--serve-arg=--seed", "--serve-arg=1", *extra]
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(1),
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), preexec_fn=ignore)
    pid, seen = None, []
    deadline = time.time() + 110
    while time.time() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if line.startswith("server pid "):
            pid = int(line.split()[2])
        if "serving" in line or not line:
            break
    assert pid is not None and f"http://127.0.0.1:{port}/v1" in seen[-1], "".join(seen)
    # keep reading: the server shares the harness's stdout, and a pipe nobody drains fills up and
    # blocks whichever of them writes next (the server logging its shutdown, say)
    threading.Thread(target=lambda: [None for _ in iter(proc.stdout.readline, "")], daemon=True).start()
    return proc, pid


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (exited, not yet reaped by init) counts as stopped
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_the_harness_stops_its_server_and_the_server_holds_toolsandboxs_30_messages(how):
    """Killing the harness left `actionopd serve` running. Now SIGTERM and SIGINT stop it
    through the harness, and SIGKILL (the harness's death without clean-up) through the kernel's
    parent-death signal. Under SIGTERM the server first shows B.3's ToolSandbox limit, per task
    id: 29 messages get a reply, 30 are refused. SIGINT reaches a harness that inherited it
    ignored (the likely cause of the 60 s hangs this test saw in full suites: the old harness
    sat on, deaf to it)."""
    port = _free_port()
    harness, server = _start_harness(port, "--bench", "toolsandbox", sigint_ignored=how == signal.SIGINT)
    try:
        if how == signal.SIGTERM:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0)
            talk = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(30)]
            ok = client.chat.completions.create(model="student", messages=talk[:29], user="toolsandbox/s1/0")
            assert ok.choices[0].message is not None
            with pytest.raises(openai.BadRequestError, match="limit of 30 messages"):
                client.chat.completions.create(model="student", messages=talk, user="toolsandbox/s1/0")
        harness.send_signal(how)
        harness.wait(timeout=60)
        deadline = time.time() + 60
        while not _gone(server) and time.time() < deadline:
            time.sleep(0.2)   # SIGKILL: the kernel's SIGTERM reaches the server; it shuts down
        assert _gone(server)
    finally:
        if harness.poll() is None:
            harness.kill()
        if not _gone(server):
            os.kill(server, signal.SIGKILL)
