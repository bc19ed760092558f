"""ToolSandbox and AppWorld through their own runners, against `actionopd serve` (issue 33 item 8).

    python launch/benchmark_harness.py --bench toolsandbox|appworld --checkpoint runs/RUN [--port 8000]
    python launch/benchmark_harness.py --print-only ...

Starts `actionopd serve` with paper table 8's evaluation settings for the student (thinking
on, greedy, at most 4,096 new tokens a reply) as SERVER-SIDE defaults, because ToolSandbox's
OpenAI agent sends no sampling fields at all, and with paper B.3's per-task limit of the
benchmark (ToolSandbox: 30 messages; AppWorld: 100,000 output tokens a task), which the server
holds per task id (each request's `user` field; serve/task_limits.py). The server's context is
the model's own (B.3's prompts plus a 4k reply need more than the 8,192 it had). It then prints
the benchmark's own runner commands. Neither benchmark nor its data installs here: this script
runs neither runner, and says so.

The server is this process's child: SIGTERM, SIGINT (Ctrl-C) and this process's exit stop it
(and on Linux the kernel sends it SIGTERM if this process dies without cleaning up).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shlex
import signal
import subprocess
import sys

# paper table 8, "Evaluation / Student: Qwen3-4B/8B": thinking enabled, greedy (T=0), 4k response
STUDENT_EVAL = {"enable_thinking": True, "temperature": 0.0, "max_response_tokens": 4096}
# paper B.3
TOOLSANDBOX = {"scenarios": 490, "trials": 4, "max_messages": 30}
APPWORLD = {"normal_tasks": 168, "challenge_tasks": 417, "max_steps": 50, "output_token_budget": 100_000}


# each benchmark's B.3 limit as `actionopd serve` flags (held per task id by the server)
BENCH_LIMITS = {"toolsandbox": ["--task-max-messages", str(TOOLSANDBOX["max_messages"])],
                "appworld": ["--task-max-output-tokens", str(APPWORLD["output_token_budget"])]}


def serve_argv(model_args: list[str], *, port: int, model_name: str, reply_limit: int,
               bench: str | None = None) -> list[str]:
    """`actionopd serve` with the student's evaluation settings as server-side defaults and
    `bench`'s B.3 limit. Its context is the model's own (serve's default; it was 8,192, where
    ToolSandbox and AppWorld prompts over ~4k tokens could not get a 4k reply)."""
    return [sys.executable, "-m", "actionopd_jax.serve.cli", *model_args, "--port", str(port),
            "--model-name", model_name, "--enable-thinking",
            "--default-temperature", str(STUDENT_EVAL["temperature"]),
            "--default-max-tokens", str(reply_limit), "--max-tokens-cap", str(reply_limit),
            *BENCH_LIMITS.get(bench or "", [])]


def harness_text(base_url: str, model_name: str) -> str:
    """The runners' commands, with what was not run here said plainly."""
    ts, aw = TOOLSANDBOX, APPWORLD
    return f"""\
NOT RUN HERE: ToolSandbox (apple/ToolSandbox) and AppWorld (StonyBrookNLP/appworld) and their
data are not installed on this host; run the commands below where they are.

export OPENAI_BASE_URL={base_url} OPENAI_API_KEY=EMPTY

# ToolSandbox: its OpenAIAPIAgent pins base_url to api.openai.com and sends only model/messages/
# tools (our server applies thinking, T=0 and the {STUDENT_EVAL['max_response_tokens']}-token limit). Register an agent role
# whose client is OpenAI(base_url=os.environ["OPENAI_BASE_URL"]) and model_name="{model_name}" in
# tool_sandbox/cli/utils.py (RoleImplType + AGENT_TYPE_TO_FACTORY); its requests must name the
# trial's task in the OpenAI `user` field (user=f"toolsandbox/{{scenario}}/{{trial}}"): the server
# counts B.3's {ts['max_messages']} messages per task and refuses (400 task_message_limit) past them.
# Then, once per trial (x{ts['trials']}):
for trial in {' '.join(str(i) for i in range(ts['trials']))}; do
  tool_sandbox --agent <YOUR_ROLE> --user GPT_4_o_2024_05_13 --parallel 16 --output_dir data/trial_$trial
done
# B.3: the {ts['scenarios']} strictly local scenarios (pass them with --scenarios; the selection of
# the paper is not published in this repository), at most {ts['max_messages']} messages each
# (the scenario's max_messages), similarity averaged over all {ts['scenarios'] * ts['trials']:,} trials.

# AppWorld: an experiment config (experiments/configs/<NAME>.jsonnet) whose model section has
#   "name": "{model_name}", "base_url": "{base_url}", "api_key_env_name": "OPENAI_API_KEY",
#   "api_type": "chat_completions", "temperature": 0, and whose requests carry the task id in the
#   OpenAI `user` field (user="appworld/<task_id>")
# and whose agent has "max_steps": {aw['max_steps']}; then
appworld run <NAME>_test_normal      # {aw['normal_tasks']} tasks
appworld evaluate <NAME>_test_normal test_normal
appworld run <NAME>_test_challenge   # {aw['challenge_tasks']} tasks
appworld evaluate <NAME>_test_challenge test_challenge
# B.3's {aw['output_token_budget']:,}-output-token budget per task is held by the server (started with
# --bench appworld): each reply is cut to what its task has left, then the task's requests are
# refused (400 task_token_budget_exhausted)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a training run directory")
    src.add_argument("--hf", help="a Hugging Face model directory")
    src.add_argument("--tiny", action="store_true", help="the random tiny model (smoke test)")
    p.add_argument("--bench", choices=sorted(BENCH_LIMITS),
                   help="the benchmark the server is for: its B.3 per-task limit (required unless --print-only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default="student")
    p.add_argument("--reply-limit", type=int, default=STUDENT_EVAL["max_response_tokens"],
                   help="tokens per reply (table 8: 4,096; lower only for smoke tests)")
    p.add_argument("--serve-arg", action="append", default=[], help="one more `actionopd serve` argument")
    p.add_argument("--print-only", action="store_true", help="print the serve and harness commands, start nothing")
    return p


class _Stop(Exception):
    """SIGTERM or SIGINT reached the harness: leave the wait, stop the server (the finally below)."""


def _die_with_parent() -> None:
    """In the server's process before it runs: Linux's PR_SET_PDEATHSIG, so the kernel sends it
    SIGTERM when the harness dies by a signal it cannot handle (SIGKILL). Elsewhere: nothing."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        except OSError:
            pass


def stop_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM (serve finishes or cancels its requests in flight and exits 0), SIGKILL if it is
    still there after `timeout_s`; its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if not (args.bench or args.print_only):
        p.error("--bench toolsandbox|appworld is required: the server holds that benchmark's B.3 limit per task")
    model = ["--checkpoint", args.checkpoint] if args.checkpoint else ["--hf", args.hf] if args.hf else ["--tiny"]
    argv_serve = serve_argv(model + args.serve_arg, port=args.port, model_name=args.model_name,
                            reply_limit=args.reply_limit, bench=args.bench)
    print("serve: " + shlex.join(argv_serve), flush=True)
    print(harness_text(f"http://127.0.0.1:{args.port}/v1", args.model_name), flush=True)
    if args.print_only:
        return 0

    def on_term(signum, frame):
        raise _Stop()

    # SIGINT too, explicitly: Python turns SIGINT into KeyboardInterrupt only where the parent
    # left it at its default, and a harness started from a shell script, nohup or a test
    # runner's worker may inherit it ignored; Ctrl-C / kill -INT must stop the server either way
    previous = signal.signal(signal.SIGTERM, on_term)
    previous_int = signal.signal(signal.SIGINT, on_term)
    proc = subprocess.Popen(argv_serve, env=dict(os.environ), preexec_fn=_die_with_parent)
    atexit.register(stop_server, proc)  # an exit past the finally below (e.g. sys.exit from elsewhere)
    print(f"server pid {proc.pid}", flush=True)
    try:
        return proc.wait()
    except (KeyboardInterrupt, _Stop):
        return stop_server(proc)
    finally:
        stop_server(proc)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
