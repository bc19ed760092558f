"""The MCP environment layer's own cost: N concurrent episodes against sandboxed notes servers
(tests/data/mcp/notes_server.py, SQLite state, reset by a tool between episodes).

    PYTHONPATH=. python benchmarks/mcp_env.py [--episodes 64] [--pool 64] [--rounds 2] [--calls 4] [--http]

The pool is warmed first (all servers started at once, timed); every round then reuses them,
reset between episodes. Prints
server start, reset per episode and tool-call latency (p50 / p99 / max), as seen by the
episodes' own event loop (a different loop from the pool's, as in the collector).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actionopd_jax.envs.mcp.client import ServerSpec  # noqa: E402
from actionopd_jax.envs.mcp.env import McpEnv  # noqa: E402
from actionopd_jax.envs.mcp.pool import McpPool  # noqa: E402
from actionopd_jax.types import Message, Task, ToolCall  # noqa: E402

NOTES = Path(__file__).resolve().parents[1] / "tests" / "data" / "mcp" / "notes_server.py"


def row(name: str, xs: list[float]) -> str:
    if not xs:
        return f"| {name} | 0 | - | - | - |"
    a = np.asarray(xs) * 1e3
    return f"| {name} | {len(a)} | {np.percentile(a, 50):.1f} | {np.percentile(a, 99):.1f} | {a.max():.1f} |"


async def run(pool: McpPool, episodes: int, rounds: int, calls: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    task = Task("bench", "mcp", payload={"prompt": "notes"})

    async def one(i: int, r: int) -> None:
        env = McpEnv(pool)
        t0 = time.perf_counter()
        await env.reset(task)
        out.setdefault(f"acquire{r}", []).append(time.perf_counter() - t0)
        for k in range(calls):
            c = ToolCall("add_note", {"text": f"n{i}.{k}"}) if k % 2 == 0 else ToolCall("list_notes", {})
            t1 = time.perf_counter()
            await env.step(c)
            out.setdefault(f"call{r}", []).append(time.perf_counter() - t1)
        await env.step(Message("done"))
        env.score()

    for r in range(rounds):
        t = time.perf_counter()
        await asyncio.gather(*(one(i, r) for i in range(episodes)))
        print(f"round {r + 1}: {episodes} episodes in {time.perf_counter() - t:.2f}s", flush=True)
        await asyncio.sleep(0.5)  # let the background resets of this round finish
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--pool", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--http", action="store_true", help="streamable HTTP servers instead of stdio")
    a = p.parse_args()
    cmd = (sys.executable, str(NOTES)) + (("--http", "{port}") if a.http else ())
    spec = ServerSpec(command=cmd, start_timeout_s=300, call_timeout_s=60)
    with McpPool(spec, size=1, reset="tool:reset_db") as alone:
        alone.warm()
        single = list(alone.stats.start_s)
    with McpPool(spec, size=a.pool, reset="tool:reset_db") as pool:
        t = time.perf_counter()
        pool.warm()  # every server up before the first episode (what a trainer does at start-up)
        print(f"warm-up: {a.pool} servers in {time.perf_counter() - t:.2f}s", flush=True)
        out = asyncio.run(run(pool, a.episodes, a.rounds, a.calls))
        stats = pool.stats
    print(f"\nMCP env layer, {a.episodes} concurrent episodes, pool {a.pool}, "
          f"{'HTTP' if a.http else 'stdio'}, {a.rounds} rounds x {a.calls} calls (ms)\n")
    print("| what | n | p50 | p99 | max |\n|---|---|---|---|---|")
    print(row("server start, one alone (spawn + sandbox + initialize + tools/list)", single))
    print(row(f"server start, {a.pool} at once (2-core contention)", stats.start_s))
    print(row("reset per episode (tool reset_db, between episodes)", stats.reset_s))
    for r in range(a.rounds):
        print(row(f"round {r + 1}: episode reset (lease a ready server)", out[f"acquire{r}"]))
        print(row(f"round {r + 1}: tool call (tools/call from the episode's loop)", out[f"call{r}"]))


if __name__ == "__main__":
    main()
