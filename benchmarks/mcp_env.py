"""The MCP environment layer's own cost: N concurrent episodes against sandboxed notes servers
(tests/data/mcp/notes_server.py, SQLite state, reset by a tool between episodes), or with
--awm DIR against an AWM pool's generated servers (AwmEnv: a keyed pool of scenario servers,
database reset by copy, the reference solution's tool calls, the verifier at the end).

    PYTHONPATH=. python benchmarks/mcp_env.py [--episodes 64] [--pool 64] [--rounds 2] [--calls 4] [--http]
    PYTHONPATH=. python benchmarks/mcp_env.py --awm tests/data/awm_mini [--episodes 64] [--pool 64] [--rounds 3]

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


async def play_reference(env, policy, task) -> dict[str, list[float]]:
    """One episode of `env` playing `policy` (a task's reference solution), timed: seconds of
    the reset (the pool's lease), of each tool call and of the score (verifier), and success."""
    times: dict[str, list[float]] = {"reset": [], "call": [], "score": []}
    t0 = time.perf_counter()
    obs = await env.reset(task)
    times["reset"].append(time.perf_counter() - t0)
    done = False
    while not done:
        action = policy.next_action(obs)
        t1 = time.perf_counter()
        obs, done = await env.step(action)
        if isinstance(action, ToolCall):
            times["call"].append(time.perf_counter() - t1)
    t2 = time.perf_counter()
    score = await asyncio.to_thread(env.score)
    times["score"].append(time.perf_counter() - t2)
    times["success"] = [float(score["success"])]
    return times


async def run_awm(make, tasks: list, episodes: int, rounds: int) -> dict[str, list[float]]:
    """`episodes` concurrent AwmEnv episodes a round (task i % len(tasks)), each playing its
    reference solution: lease (reset), tool calls, final answer, score (verifier)."""
    from actionopd_jax.envs.reference import reference_policy

    out: dict[str, list[float]] = {}

    async def one(i: int, r: int) -> None:
        task = tasks[i % len(tasks)]
        times = await play_reference(make(task), reference_policy(task), task)
        for kind, xs in times.items():
            out.setdefault(f"{'acquire' if kind == 'reset' else kind}{r}", []).extend(xs)

    for r in range(rounds):
        t = time.perf_counter()
        await asyncio.gather(*(one(i, r) for i in range(episodes)))
        print(f"round {r + 1}: {episodes} episodes in {time.perf_counter() - t:.2f}s", flush=True)
        await asyncio.sleep(0.5)
    return out


def main_awm(a) -> None:
    import tempfile

    from actionopd_jax.config import EnvConfig
    from actionopd_jax.envs.awm.factory import awm_env_factory
    from actionopd_jax.envs.awm.layout import load_awm

    data = load_awm(a.awm)
    # code-verified tasks with a reference solution (the SQL mode would add a judge's HTTP latency)
    tasks = [t for t in data.tasks() if t.payload.get("reference_solution")
             and data.scenario_of(t).verifier(t.payload["task_idx"], "code") is not None]
    if not tasks:
        raise SystemExit(f"{a.awm}: no code-verified task has a reference solution (reference_solutions.jsonl, "
                         "our mini pool's)")
    cache = tempfile.mkdtemp(prefix="awm-bench-db-")
    env = EnvConfig(name="awm", awm_dir=a.awm, mcp_pool_size=1, mcp_call_timeout_s=120)
    alone = awm_env_factory(env, cache_dir=cache)
    alone.runtime.start_timeout_s = 300
    alone.warm(tasks[:1])
    single = list(alone.runtime.pool.stats.start_s)
    alone.close()
    make = awm_env_factory(EnvConfig(name="awm", awm_dir=a.awm, mcp_pool_size=a.pool, mcp_call_timeout_s=120),
                           cache_dir=cache)
    make.runtime.start_timeout_s = 300
    pool = make.runtime.pool
    t = time.perf_counter()
    keys = [tasks[i % len(tasks)].payload["scenario"] for i in range(a.pool)]

    async def warm_all():  # every slot up before the first episode, spread over the scenarios
        servers = await asyncio.gather(*(pool.acquire(k) for k in keys))
        await asyncio.gather(*(pool.release(s, ok=True) for s in servers))

    asyncio.run(warm_all())
    print(f"warm-up: {a.pool} servers in {time.perf_counter() - t:.2f}s", flush=True)
    starts = list(pool.stats.start_s)
    pool.stats.reset_s.clear()
    out = asyncio.run(run_awm(make, tasks, a.episodes, a.rounds))
    stats = pool.stats
    make.close()
    print(f"\nAWM env layer ({a.awm}: {len(make.runtime.dataset.scenarios)} scenarios, {len(tasks)} code-verified tasks), "
          f"{a.episodes} concurrent episodes, pool {a.pool}, stdio, {a.rounds} rounds (ms)\n")
    print("| what | n | p50 | p99 | max |\n|---|---|---|---|---|")
    print(row("server start, one alone (DB copy + spawn + sandbox + initialize + tools/list)", single))
    print(row(f"server start, {a.pool} at once", starts))
    print(row("reset per episode (DB copy, SQLite backup API, between episodes)", stats.reset_s))
    for r in range(a.rounds):
        print(row(f"round {r + 1}: episode reset (lease a ready server)", out[f"acquire{r}"]))
        print(row(f"round {r + 1}: tool call (tools/call from the episode's loop)", out[f"call{r}"]))
        print(row(f"round {r + 1}: score (DB snapshot done; sandboxed verifier)", out[f"score{r}"]))
    print(f"\nverifier success of the reference solutions: {np.mean(out['success0']):.2f}; starts {stats.starts}, "
          f"evicted {stats.evicted}, discarded {stats.discarded}, reset failures {stats.reset_failures}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--pool", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--http", action="store_true", help="streamable HTTP servers instead of stdio")
    p.add_argument("--awm", default="", help="an AWM pool directory (with reference_solutions.jsonl: our mini pool)")
    a = p.parse_args()
    if a.awm:
        return main_awm(a)
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
