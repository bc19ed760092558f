"""The matcher's execution stage on AWM episodes (issue 45): each fork is a server of the
scenario from the runtime's fork pool (the episodes' factory: same sandbox and limits) loaded with
a copy of the live episode's SQLite database; our mini AWM pool (tests/data/awm_mini)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actionopd_jax.config import EnvConfig
from actionopd_jax.envs.awm.fork import dump_db
from actionopd_jax.envs.awm.layout import load_awm
from actionopd_jax.envs.awm.factory import awm_env_factory
from actionopd_jax.matching.execution import ExecutionStage, call_key
from actionopd_jax.types import ToolCall as T

AWM = Path(__file__).parent / "data" / "awm_mini"
TASKS = {t.task_id: t for t in load_awm(AWM).tasks()}


@pytest.fixture(scope="module")
def make(tmp_path_factory):
    d = tmp_path_factory.mktemp("awm")
    factory = awm_env_factory(EnvConfig(name="awm", awm_dir=str(AWM), mcp_pool_size=2), judge=None,
                              cache_dir=str(d / "dbcache"))
    try:
        yield factory
    finally:
        factory.close()


PAIRS = [  # (student, teacher, what execution must say: match / no_match / None for the judge)
    (T("borrow_book", {"book_id": 2}), T("borrow_book", {"book_id": "2"}), "match"),   # the same write
    (T("borrow_book", {"book_id": 2}), T("borrow_book", {"book_id": 1}), "no_match"),   # one argument off
    (T("borrow_book", {"book_id": 2}), T("borrow_book", {"book_id": 999}), None),       # fails: the judge
]


def test_awm_pairs_are_decided_on_forked_databases_and_the_episode_is_untouched(make):
    task = TASKS["library_loans_1/0"]

    async def go():
        env = make(task)
        await env.reset(task)
        point = await env.fork_point()
        record = await ExecutionStage().decide(point, [(s, t) for s, t, _ in PAIRS])
        point.close()
        live = dump_db(await asyncio.to_thread(make.runtime.snapshot, env._server, env._dir / "live.db"))
        obs, _ = await env.step(T("borrow_book", {"book_id": 2}))  # the live episode still has its copy
        env.end("test")
        await asyncio.to_thread(env.score)
        return point.before, live, obs, record

    before, live, obs, record = asyncio.run(go())
    got = [record.verdicts.get((call_key(s), call_key(t))) for s, t, _ in PAIRS]
    assert got == [want for _, _, want in PAIRS], record.abstained
    assert live == before
    assert "no copy available" not in obs.messages[-1]["content"]
    assert make.runtime._fork_pool is not None and make.runtime.pool.stats.keys_started["library_loans_1"] == 1
