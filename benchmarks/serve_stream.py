"""Time to the first streamed chunk against the whole reply, `actionopd serve --tiny` with the
static sampler and with the engine (issue 25, serve); the tiny model's context is 4,096, the
engine's slots hold that by default, or 512 (`--engine-max-len`). Each server is a real process; one
streaming request with a long max_tokens is timed with the `openai` client after a warm-up
request has compiled the programs.

    PYTHONPATH=. python benchmarks/serve_stream.py [--max-tokens 400] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import openai


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(flags: list[str]) -> tuple[subprocess.Popen, openai.OpenAI, float]:
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "actionopd_jax.commands", "serve", "--tiny", "--seed", "1",
                             "--port", str(port), *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"serve {' '.join(flags)} exited before serving")
        if "serving" in line:
            break
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    return proc, client, time.perf_counter() - t0


def one_stream(client: openai.OpenAI, max_tokens: int, seed: int) -> tuple[float, float, int, int]:
    """(seconds to the first text chunk, seconds to the end, text chunks, completion tokens)."""
    t0 = time.perf_counter()
    first, chunks, tokens = None, 0, 0
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell a story."}],
                                                max_tokens=max_tokens, seed=seed, stream=True,
                                                stream_options={"include_usage": True}):
        for c in chunk.choices:
            if c.delta.content or (c.delta.model_extra or {}).get("reasoning_content"):
                chunks += 1
                first = first if first is not None else time.perf_counter() - t0
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return first if first is not None else float("nan"), time.perf_counter() - t0, chunks, tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print("| serve flags | start + first reply s | first chunk s | total s | text chunks | tokens |")
    print("|---|---|---|---|---|---|")
    for flags in (["--sampler", "static"], ["--sampler", "engine"], ["--sampler", "engine", "--engine-max-len", "512"]):
        sampler = " ".join(flags)
        proc, client, startup = start(flags)
        try:
            for seed in range(args.repeats):
                first, total, chunks, tokens = one_stream(client, args.max_tokens, seed)
                print(f"| {sampler} | {startup:.1f} | {first:.3f} | {total:.3f} | {chunks} | {tokens} |", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
