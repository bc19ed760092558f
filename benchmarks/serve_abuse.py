"""`actionopd serve --tiny` under abuse (issue 34), each a real server process and the real
`openai` client:

- bodies: 3 concurrent near-limit bodies (just under the 8 MB limit, far over the context);
  the server's RSS (VmRSS sampled every 20 ms) before and at its peak, and the time until all
  three have their answer;
- shutdown: N long streaming requests in flight get SIGTERM, and again 2 s later; how long until
  the process exits, its exit code, and what each client saw (a finished stream, a stream that
  ended cleanly without a finish reason, or a connection error), with the grace the server
  promised.

    PYTHONPATH=. python benchmarks/serve_abuse.py [--part bodies|shutdown|all] [--streams 40]
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import threading
import time

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_stream import _free_port  # noqa: E402 - the sibling benchmark's helper


def start(flags: list[str]) -> tuple[subprocess.Popen, openai.OpenAI, list[str]]:
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "actionopd_jax.commands", "serve", "--tiny", "--seed", "1",
                             "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log: list[str] = []
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("serve exited before serving:\n" + "".join(log))
        log.append(line)
        if "serving" in line:
            break
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
    return proc, client, log


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def bodies() -> int:
    proc, client, _ = start([])
    try:
        idle = rss_mb(proc.pid)
        peak, done = idle, []
        text = "weather " * ((8 * 1024 * 1024 - 4096) // 8)   # just under the 8 MB body limit

        def one() -> None:
            try:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}])
                done.append("200")
            except openai.APIStatusError as e:
                done.append(str(e.status_code))

        threads = [threading.Thread(target=one) for _ in range(3)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak = max(peak, rss_mb(proc.pid))
            time.sleep(0.02)
        took = time.perf_counter() - t0
        print("| bodies | server RSS idle -> peak (MB) | growth | all answered in (s) | statuses |")
        print("|---|---|---|---|---|")
        print(f"| 3 x {len(text) / 2**20:.1f} MiB | {idle:.0f} -> {peak:.0f} | +{peak - idle:.0f} MB | {took:.2f} | "
              f"{', '.join(sorted(done))} |")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0


def shutdown(args: argparse.Namespace) -> int:
    slots = args.engine_slots or args.streams
    proc, client, log = start(["--engine-slots", str(slots), "--shutdown-grace", str(args.grace)])
    outcome: dict[int, str] = {}
    started = threading.Semaphore(0)

    def one(i: int) -> None:
        first = True
        finish = None
        try:
            for chunk in client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"Tell story {i}."}],
                    max_tokens=args.max_tokens, seed=i, stream=True):
                if first:
                    first = False
                    started.release()
                for c in chunk.choices:
                    finish = c.finish_reason or finish
            outcome[i] = f"finished ({finish})" if finish else "ended cleanly, no finish reason"
        except openai.APIConnectionError:   # the connection dropped: no terminal event
            outcome[i] = ("connection dropped (APIConnectionError) before any chunk" if first else
                          "connection dropped (APIConnectionError) mid-stream")
        except openai.APIError as e:        # an error event in the stream: a terminal event
            outcome[i] = f"error event ({getattr(e, 'code', None) or type(e).__name__})"
        finally:
            if first:
                started.release()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(args.streams)]
    for t in threads:
        t.start()
    for _ in range(min(slots, len(threads))):
        started.acquire()  # every slot streams (fewer slots than streams: the rest are queued)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    second = None
    while proc.poll() is None:
        if second is None and time.perf_counter() - t0 >= args.second_after_s:
            proc.send_signal(signal.SIGTERM)
            second = time.perf_counter() - t0
        time.sleep(0.01)
    exited = time.perf_counter() - t0
    for t in threads:
        t.join(timeout=30)
    counts = collections.Counter(outcome.values())
    promise = next((x.strip() for x in log if x.startswith("shutting down")), "(no shutdown line)")
    print("| streams (slots) | exit code | SIGTERM -> exit (s) | second SIGTERM at (s) | clients |")
    print("|---|---|---|---|---|")
    print(f"| {args.streams} ({slots}) | {proc.returncode} | {exited:.2f} | "
          f"{'-' if second is None else f'{second:.1f}'} | "
          f"{', '.join(f'{n} {what}' for what, n in sorted(counts.items()))} |")
    print(f"server said: {promise}")
    if proc.returncode != 0:   # what the server said last
        print("server log (last 25 lines):", *[x.rstrip() for x in log[-25:]], sep="\n  ")
    return 0 if proc.returncode == 0 else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("bodies", "shutdown", "all"), default="all")
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=3000)
    p.add_argument("--second-after-s", type=float, default=2.0)
    p.add_argument("--grace", type=float, default=10.0, help="the server's --shutdown-grace")
    p.add_argument("--engine-slots", type=int, default=0,
                   help="the server's slots (default: one per stream); fewer queue the rest, so the shutdown "
                        "outlasts its grace and cancels them")
    args = p.parse_args()
    code = 0
    if args.part in ("bodies", "all"):
        code |= bodies()
    if args.part in ("shutdown", "all"):
        code |= shutdown(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
