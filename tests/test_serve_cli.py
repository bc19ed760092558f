"""`actionopd serve` and `actionopd generate` as a user runs them (the --tiny model)."""

import os
import socket
import subprocess
import sys
import time

import openai
import pytest

from actionopd_jax.sampling import cli as generate_cli


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_generate_tiny_prints_samples(capsys):
    assert generate_cli.main(["--tiny", "--prompt", "Hi", "--n", "2", "--max-new-tokens", "5", "--seed", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- sample") == 2 and "[seed 4;" in out


def test_generate_reports_bad_model_dir(tmp_path, capsys):
    assert generate_cli.main(["--hf", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_serve_subprocess_with_bearer_token():
    port = _free_port()
    env = {**os.environ, "TINY_SERVE_KEY": "s3cret-for-test"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "actionopd_jax.commands", "serve", "--tiny", "--seed", "1", "--port", str(port),
         "--api-key-env", "TINY_SERVE_KEY", "--default-max-tokens", "6", "--lm-head", "float32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.time() + 120
        line, seen = "", []
        while time.time() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if "serving" in line or not line:
                break
        assert f"http://127.0.0.1:{port}/v1" in line, line
        # the programs are compiled before the port reports ready (issue 34 item 9)
        assert any(x.startswith("warm-up: the first request's programs compiled in") for x in seen), seen
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret-for-test", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2)
        assert len(r.choices) == 2 and r.usage.completion_tokens <= 12
        wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
