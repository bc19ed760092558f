"""Server starts kept off the device step's path: `KeyedPool.prefetch` starts the servers of
upcoming task starts in the background (the pool AWM episodes lease from), an episode whose key
is being prefetched takes that server instead of starting a second one, and in a collection the
later episodes find their servers warm instead of each waiting for a start in turn. Real
sandboxed MCP servers (tests/data/mcp/notes_server.py) made slow to start on purpose."""

from __future__ import annotations

import asyncio
import sys
import time

from actionopd_jax.envs.mcp.client import McpServer, ServerSpec
from actionopd_jax.envs.mcp.env import McpEnv
from actionopd_jax.envs.mcp.keyed_pool import KeyedPool
from actionopd_jax.types import Message, Task
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (Script, collect_once, collector_config, fixed_text_sample_fn, judge_backend,
                                     make_collector, make_matcher, make_teacher, serve, teacher_backend)
from tests.test_env_mcp import NOTES

DELAY_S = 1.5  # each server sleeps this long before serving: a cold start costs at least this
SLOW = ("import runpy, sys, time; time.sleep(float(sys.argv[1])); sys.argv = sys.argv[2:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')")


def slow_pool(size: int, delay_s: float = DELAY_S) -> KeyedPool:
    spec = ServerSpec(command=(sys.executable, "-c", SLOW, str(delay_s), NOTES), start_timeout_s=60)

    async def reset(key, server) -> bool:
        return not (await server.call("reset_db", {})).is_error

    return KeyedPool(lambda key: McpServer(spec), size=size, reset=reset)


def idle_keys(pool: KeyedPool) -> list:
    return sorted(pool.key_of(s) for s in pool._idle)


def test_prefetch_returns_at_once_and_an_episode_takes_the_prefetched_server():
    with slow_pool(4, delay_s=3.0) as pool:   # each start 3 s: returning within one start is "at once" on any load
        future = pool.prefetch(["a", "b", "a"])  # "a" drawn twice: two servers
        # the caller (the step) goes on while they start: each start takes 3 s, so a prefetch
        # that waited for them would return a finished future (no duration asserted)
        assert not future.done()

        async def lease(key):  # arrives while its server is still starting: waits for that one
            server = await pool.acquire(key)
            await pool.release(server, ok=True)

        asyncio.run(lease("a"))
        assert future.result(60) == 3
        assert pool.stats.starts == 3 == pool.stats.prefetched and pool.stats.keys_started == {"a": 2, "b": 1}
        assert idle_keys(pool) == ["a", "a", "b"]
        # the next step wants c, d and an a: the one free slot and the idle b (a key it does not
        # want) make room; the idle a's are not evicted for it
        assert pool.prefetch(["c", "a", "d"]).result(60) == 2
        assert idle_keys(pool) == ["a", "a", "c", "d"] and pool.stats.evicted == 1
        # everything wanted is idle already: nothing starts
        assert pool.prefetch(["d", "c"]).result(10) == 0 and pool.stats.starts == 5


def test_later_episodes_find_their_servers_started_while_earlier_ones_ran(tiny_tokenizer):
    """One trajectory at a time over 4 task starts of 4 keys: without prefetching each
    episode's reset would wait for its own cold start (>= DELAY_S, one after another); the
    collector prefetches the step's starts, so the servers start together and only the first
    episode waits."""
    pool = slow_pool(4)
    tasks = [Task(f"t{i}", "mcp", payload={"prompt": "case=pf say done", "tools": [], "key": f"k{i}"})
             for i in range(4)]

    def make(task):
        return McpEnv(pool.view(task.payload["key"]))

    make.prefetch = lambda ts: pool.prefetch([t.payload["key"] for t in ts])
    done = Message("Done.")
    script = Script(teacher={("pf", 0): [done] * 3}, student={("pf", 0): [done] * 4})
    cfg = collector_config(max_trajectories_in_flight=1, env_timeout_s=60.0, decision_limits=(("mcp", 1),),
                           max_prompt_tokens=4096)
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    try:
        with serve(teacher_backend(script), judge_backend()) as server:
            collector = make_collector(cfg, tiny_tokenizer, make_teacher(server), make_matcher(server),
                                       fixed_text_sample_fn(tiny_tokenizer, script, eos), env_factory=make)
            t0 = time.perf_counter()
            result = collect_once(collector, tasks, step=0, process_index=0, process_count=1)
            wall = time.perf_counter() - t0
    finally:
        pool.close()
    assert [r.end_reason for r in result.trajectories] == ["env_done"] * 4
    assert pool.stats.starts == 4 == pool.stats.prefetched  # no episode started a second server
    waits = sorted(pool.stats.acquire_s)
    assert waits[-1] >= DELAY_S  # the first episode waited for a start...
    # ...and the episodes' waits together are below the starts' own time: the others found
    # their servers (mostly) started, instead of each waiting for a start in turn (a relation
    # between two measured sums, not a wall-clock threshold: issue 32)
    assert sum(waits) < sum(pool.stats.start_s), (waits, pool.stats.start_s)
    # the starts overlapped: the whole step took less than the starts one after another would
    assert wall < sum(pool.stats.start_s), (wall, pool.stats.start_s)


def test_the_mixture_shows_its_next_step_without_drawing_it():
    """What the run prefetches after a step (collect/source.py) is exactly the next step's draw."""
    from actionopd_jax.envs.mixture import MixtureStream

    pools = [(p, [Task(f"{p}{i}", p) for i in range(n)], c) for p, n, c in (("awm", 50, 3), ("envscaler", 7, 2))]
    stream = MixtureStream(pools, seed=3)
    stream.next_task()  # a resumed stream may stand mid-step
    state = stream.get_state()
    ahead = stream.peek_step()
    assert stream.get_state() == state and stream.peek_step() == ahead
    assert stream.next_step() == ahead and stream.peek_step() != ahead
