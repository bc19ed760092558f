"""launch/benchmark_harness.py (issue 33 item 8): `actionopd serve` started with table 8's student
evaluation settings as server-side defaults; a harness request that omits sampling fields gets
them, and the reply limit holds whatever max_tokens a request asks."""

import socket
import subprocess
import time

import openai

from actionopd_jax.launch.harness import APPWORLD, STUDENT_EVAL, TOOLSANDBOX, harness_text, serve_argv


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
