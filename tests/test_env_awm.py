"""AWM episodes (`env.name: awm`, actionopd_jax/envs/awm/env.py) over the mini pool's real
generated-style servers, each a contained subprocess reached over real MCP stdio: tools from
tools/list, calls changing the episode's SQLite copy, state kept within an episode and reset
(by database copy, same server) between episodes; the verifier's verdict for scripted correct
and wrong episodes in both modes, the SQL mode's judge a real OpenAI-compatible server on
127.0.0.1; matcher evidence with the tools' source; faults and kill -9 containment."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from actionopd_jax.config import ConfigError, EnvConfig
from actionopd_jax.envs.awm.factory import awm_env_factory
from actionopd_jax.envs.awm.layout import load_awm
from actionopd_jax.envs.awm.runtime import tool_sources
from actionopd_jax.envs.mcp.client import McpFault
from actionopd_jax.envs.registry import env_factory_from
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.types import Message, ToolCall
from tests._collect_fixtures import serve, servers_under, wait_for_servers

AWM = Path(__file__).parent / "data" / "awm_mini"
TASKS = {t.task_id: t for t in load_awm(AWM).tasks()}


def factory(tmp_path, *, awm_dir=AWM, pool=2, judge=None, **env):
    return awm_env_factory(EnvConfig(name="awm", awm_dir=str(awm_dir), mcp_pool_size=pool, **env),
                           judge=judge, cache_dir=str(tmp_path / "dbcache"))


@pytest.fixture(scope="module")
def judged():
    """(factory over the mini pool, 3 servers at most, whose SQL verifier asks `backend`; backend)."""
    backend = judge_server_backend()
    with serve(backend) as server, __import__("tempfile").TemporaryDirectory() as d:
        judge = {"base_url": server.base_url, "model": "awm-judge", "api_key_env": None, "temperature": 0.0,
                 "max_tokens": 128, "request_timeout_s": 20}
        make = factory(Path(d), pool=3, judge=judge)
        try:
            yield make, backend
        finally:
            make.close()


async def play(make, task_id: str, actions: list) -> tuple[list[str], dict]:
    """One episode of scripted actions (the last a Message); the tool messages and the score."""
    env = make(TASKS[task_id])
    obs = await env.reset(TASKS[task_id])
    for a in actions:
        obs, done = await env.step(a)
    assert done
    score = await asyncio.to_thread(env.score)
    return [m["content"] for m in obs.messages if m["role"] == "tool"], score


def test_tools_calls_state_within_and_reset_between_episodes_on_one_server(judged):
    make, _ = judged

    async def main():
        env = make(TASKS["library_loans_1/0"])
        obs = await env.reset(TASKS["library_loans_1/0"])
        names = [t["function"]["name"] for t in obs.tools]
        assert names == ["search_books", "borrow_book", "return_book", "list_my_loans"]  # tools/list
        borrow = obs.tools[1]["function"]
        assert borrow["description"] == "Borrow one copy of a book for the current member."
        assert borrow["parameters"]["properties"]["book_id"]["type"] == "integer"
        assert [m["role"] for m in obs.messages] == ["system", "user"]
        assert obs.messages[1]["content"] == "Borrow a copy of 'Salt and Stars'."
        obs, _ = await env.step(ToolCall("borrow_book", {"book_id": 2}))
        obs, _ = await env.step(ToolCall("borrow_book", {"book_id": 2}))  # state kept: 1 copy, now 0
        assert "no copy available" in obs.messages[-1]["content"]
        assert obs.messages[-1]["role"] == "tool" and obs.messages[-1]["name"] == "borrow_book"
        obs, done = await env.step(Message("Borrowed."))
        assert done
        first = await asyncio.to_thread(env.score)
        # the next episode gets the same server with its database copied back to the initial one
        tools, second = await play(make, "library_loans_1/0", [ToolCall("borrow_book", {"book_id": 2}),
                                                                 Message("Borrowed.")])
        return first, tools, second

    first, tools, second = asyncio.run(main())
    assert first["reward"] == 1.0 and first["success"] and first["verdict"] == "complete"
    assert first["verifier_mode"] == "code" and first["tool_calls"] == 2
    assert '"changed": 1' in tools[0] and "error" not in tools[0]  # the copy was available again
    assert second["reward"] == 1.0
    stats = make.runtime.pool.stats
    assert stats.keys_started["library_loans_1"] == 1 and stats.resets >= 1  # one server, reset by copy, reused


def test_code_verifier_scores_a_correct_and_a_wrong_episode_with_the_final_answer(judged):
    make, _ = judged

    async def main():
        ok = await play(make, "gym_classes_3/2", [ToolCall("list_classes", {"day": "wednesday"}),
                                                  ToolCall("book_class", {"class_id": 3}), Message("Booked.")])
        wrong = await play(make, "gym_classes_3/2", [ToolCall("book_class", {"class_id": 2}), Message("Booked.")])
        told = await play(make, "library_loans_1/3", [Message("You can borrow 3 of them.")])
        miscount = await play(make, "library_loans_1/3", [Message("You can borrow 2 of them.")])
        return ok[1], wrong, told[1], miscount[1]

    ok, (wrong_tools, wrong), told, miscount = asyncio.run(main())
    assert (ok["reward"], ok["verdict"]) == (1.0, "complete")
    assert "the class is full" in wrong_tools[0]  # Monday's Yoga has no place left
    assert (wrong["reward"], wrong["success"], wrong["verdict"]) == (0.0, False, "others")
    assert told["reward"] == 1.0 and miscount["reward"] == 0.0  # the verifier reads the final answer


def judge_server_backend():
    """A judge that reads the facts the SQL verifier returned: complete when the quickest japanese
    recipe is among the favourites, else incomplete."""
    def reply(req):
        payload = json.loads(req.messages[-1]["content"])
        facts = payload["check_output"]
        done = facts["quickest_japanese_recipe"] in facts["favourite_titles"]
        return message_choice(json.dumps({"classification": "complete" if done else "incomplete",
                                          "reasoning": "read from the facts"}))

    return ScriptedBackend("awm-judge", reply)


def test_sql_verifier_asks_the_runs_judge_over_http(judged):
    make, backend = judged
    backend.requests.clear()

    async def main():
        ok = await play(make, "recipe_box_2/3", [ToolCall("list_recipes", {"cuisine": "japanese"}),
                                                 ToolCall("add_favorite", {"recipe_id": 2}), Message("Done.")])
        wrong = await play(make, "recipe_box_2/3", [ToolCall("add_favorite", {"recipe_id": 1}), Message("Done.")])
        return ok[1], wrong[1]

    ok, wrong = asyncio.run(main())
    assert (ok["verifier_mode"], ok["verdict"], ok["reward"], ok["success"]) == ("sql", "complete", 1.0, True)
    assert (wrong["verdict"], wrong["reward"], wrong["success"]) == ("incomplete", 0.0, False)
    assert len(backend.requests) == 2
    sent = json.loads(backend.requests[0].messages[-1]["content"])
    assert sent["task"] == "Favourite the quickest japanese recipe."
    assert sorted(sent["check_output"]["favourite_titles"]) == ["Miso Glazed Aubergine", "Slow Ragu"]
    assert any(m.get("tool_calls") for m in sent["trajectory"])  # the judge sees what the agent did
    assert backend.requests[0].max_tokens == 512  # AWM's judge gets room for its reasoning

    judge, make.runtime.judge = make.runtime.judge, None  # a run without a judge endpoint
    try:
        _, score = asyncio.run(play(make, "gym_classes_3/3", [Message("It starts at 19:00.")]))
    finally:
        make.runtime.judge = judge
    assert score["verdict"] == "judge_error" and score["reward"] == 0.0 and not score["success"]
    assert "judge endpoint" in score["verifier_error"]


def test_evidence_is_each_tools_source_description_and_schema(tmp_path):
    sources = tool_sources(load_awm(AWM).scenarios["recipe_box_2"].server_code)
    assert set(sources) == {"list_recipes", "add_favorite", "remove_favorite", "create_recipe", "_rows", "_write"}
    assert sources["add_favorite"].startswith('@mcp.tool(name="add_favorite"')
    fastapi = 'import x\n@app.post("/api/loans", operation_id="borrow_book")\nasync def borrow(book_id: int):\n    return 1\n'
    assert tool_sources(fastapi) == {"borrow": fastapi.split("\n", 1)[1].rstrip("\n"),
                                     "borrow_book": fastapi.split("\n", 1)[1].rstrip("\n")}
    make = factory(tmp_path, pool=3)
    try:
        evidence = make.tool_evidence([TASKS["recipe_box_2/0"], TASKS["gym_classes_3/1"]])
        assert make.runtime.pool.stats.starts == 2  # warmed: one server per scenario, left idle
        make.warm([TASKS["recipe_box_2/0"], TASKS["gym_classes_3/1"]])
        assert make.runtime.pool.stats.starts == 2  # already warm
        asyncio.run(play(make, "gym_classes_3/1", [Message("Nothing to do.")]))
        assert make.runtime.pool.stats.starts == 2  # the episode got a warm server
    finally:
        make.close()
    assert set(evidence) == {"awm/recipe_box_2", "awm/gym_classes_3"}
    ev = evidence["awm/gym_classes_3"]["book_class"]
    assert "Book a place in a class for the current user." in ev and '"class_id"' in ev
    assert "# implementation:" in ev and "the class is full" in ev
    assert TASKS["gym_classes_3/1"].payload["evidence_scope"] == "awm/gym_classes_3"


def test_registry_builds_awm_and_checks_the_manifest_against_the_dir(tmp_path):
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"pools": {"awm": {"admitted": ["library_loans_1/0", "nowhere_9/0"]}}}))
    with pytest.raises(ConfigError, match="not tasks of env.awm_dir"):
        env_factory_from(EnvConfig(name="awm", awm_dir=str(AWM), manifest=str(manifest)))
    with pytest.raises(ConfigError, match="cannot load it as an AWM pool"):
        env_factory_from(EnvConfig(name="awm", awm_dir=str(tmp_path)))
    manifest.write_text(json.dumps({"pools": {"awm": {"admitted": ["library_loans_1/0"],
                                                      "verifier_modes": {"library_loans_1/0": "sql"}}}}))
    make = env_factory_from(EnvConfig(name="awm", awm_dir=str(AWM), manifest=str(manifest)), concurrency=4)
    try:
        assert make.runtime.pool_size == 4 and make.runtime.modes == {"library_loans_1/0": "sql"}
        assert make.runtime._pool is None  # nothing started by building it (what --check does)
    finally:
        make.close()
    with pytest.raises(ConfigError, match="env.manifest"):  # a mixture with EnvScaler reads its admitted tasks
        env_factory_from(EnvConfig(name="awm", awm_dir=str(AWM), envscaler_dir="x",
                                   mixture=("awm:59", "envscaler:5")))


HOSTILE_TOOLS = '''

@mcp.tool(name="crash", description="Exit at once.")
def crash() -> dict:
    os._exit(3)


@mcp.tool(name="hang", description="Never answer.")
def hang() -> dict:
    import time
    time.sleep(600)
    return {}


@mcp.tool(name="probe", description="Look around.")
def probe(target: str) -> dict:
    try:
        with open(target, "w") as f:
            f.write("x")
        wrote = True
    except OSError:
        wrote = False
    return {"env": sorted(os.environ), "wrote": wrote}
'''


def test_faults_end_their_episode_with_the_reason_and_the_others_go_on(tmp_path, monkeypatch):
    """A scenario server that dies mid-episode, one whose tool call hangs, and one that looks for
    secrets and writes outside its directory: each episode ends (or is contained) with its reason,
    a concurrent episode completes, and a fresh server replaces the dead one."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-of-the-trainer")
    pool_dir = tmp_path / "awm"
    shutil.copytree(AWM, pool_dir)
    rows = [json.loads(line) for line in (pool_dir / "gen_envs.jsonl").read_text().splitlines()]
    for r in rows:
        r["full_code"] = r["full_code"].replace('\n\nif __name__ == "__main__":', HOSTILE_TOOLS + '\n\nif __name__ == "__main__":')
    (pool_dir / "gen_envs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the 2 s call limit only where the call must time out (the hang): every call that answers
    # or dies gets 60 s, so a loaded host cannot turn its verdict into a timeout
    make = factory(tmp_path, awm_dir=pool_dir, pool=3, mcp_call_timeout_s=60.0)
    make_hang = factory(tmp_path / "hang", awm_dir=pool_dir, pool=1, mcp_call_timeout_s=2.0)
    tasks = {t.task_id: t for t in load_awm(pool_dir).tasks()}
    outside = tmp_path / "outside.txt"
    try:
        async def crash():
            env = make(tasks["recipe_box_2/0"])
            await env.reset(tasks["recipe_box_2/0"])
            await env.step(ToolCall("add_favorite", {"recipe_id": 3}))
            with pytest.raises(McpFault) as err:
                await env.step(ToolCall("crash", {}))
            return err.value, await asyncio.to_thread(env.score)

        async def fine():
            env = make(tasks["recipe_box_2/1"])
            await env.reset(tasks["recipe_box_2/1"])
            await asyncio.sleep(0.5)  # still running while the other server dies
            await env.step(ToolCall("remove_favorite", {"recipe_id": 4}))
            await env.step(Message("Removed."))
            return await asyncio.to_thread(env.score)

        async def probe():
            env = make(tasks["gym_classes_3/0"])
            obs = await env.reset(tasks["gym_classes_3/0"])
            obs, _ = await env.step(ToolCall("probe", {"target": str(outside)}))
            return json.loads(obs.messages[-1]["content"])

        async def hang():
            env = make_hang(tasks["gym_classes_3/0"])
            await env.reset(tasks["gym_classes_3/0"])
            with pytest.raises(McpFault) as err:
                await env.step(ToolCall("hang", {}))
            return err.value, await asyncio.to_thread(env.score)

        async def main():
            return await asyncio.gather(crash(), fine(), probe(), hang())

        (fault, crashed), ok, seen, (timeout, hung) = asyncio.run(main())
        assert "OPENAI_API_KEY" not in seen["env"] and "DATABASE_PATH" in seen["env"]
        assert not seen["wrote"] and not outside.exists()  # read-only outside its own directory
        assert timeout.end_reason == "mcp_timeout" and hung["end_reason"] == "mcp_timeout"
        assert hung["verdict"] == "not_verified"
        assert fault.end_reason == "mcp_connection_lost"
        assert crashed["end_reason"] == "mcp_connection_lost" and crashed["verdict"] == "not_verified"
        assert crashed["reward"] == 0.0 and crashed["fault"]
        assert ok["reward"] == 1.0 and ok["end_reason"] == "completed"
        _, again = asyncio.run(play(make, "recipe_box_2/1", [ToolCall("remove_favorite", {"recipe_id": 4}),
                                                             Message("Removed.")]))
        assert again["reward"] == 1.0  # a fresh server replaced the dead one
        assert make.runtime.pool.stats.discarded >= 1
    finally:
        make.close()
        make_hang.close()


KILLED_TRAINER = """
import asyncio, sys, time
sys.path.insert(0, {root!r})
from actionopd_jax.config import EnvConfig
from actionopd_jax.envs.awm.factory import awm_env_factory
from actionopd_jax.envs.awm.layout import load_awm
make = awm_env_factory(EnvConfig(name="awm", awm_dir={awm!r}, mcp_pool_size=3), cache_dir={cache!r})
make.warm(load_awm({awm!r}).tasks())
print("READY", flush=True)
time.sleep(600)
"""


def scratch_of(tmp: Path) -> Path:
    """envs/scratch.py's base for a process whose TMPDIR is `tmp`."""
    return tmp / f"actionopd-scratch-{os.getuid()}"


def test_no_awm_server_outlives_a_kill_9_of_the_trainer_and_the_next_start_removes_its_files(tmp_path):
    from actionopd_jax.envs.scratch import owned_dir

    code = KILLED_TRAINER.format(root=str(Path(__file__).parents[1]), awm=str(AWM), cache=str(tmp_path / "c"))
    # the server code files live in the trainer's scratch dir, under tmp_path: their paths mark the servers
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(tmp_path)})
    left = scratch_of(tmp_path) / str(trainer.pid)
    try:
        assert trainer.stdout.readline().strip() == "READY"
        assert len(servers_under(str(left / "awm-code-"))) >= 3
        assert owned_dir(scratch_of(tmp_path)) != left and left.is_dir()  # a live owner's files are kept
        trainer.kill()
        trainer.wait(10)
        assert wait_for_servers(str(left / "awm-code-"), gone=True, within_s=10) == []
    finally:
        trainer.kill()
    # the servers' code, databases and stderr files stay after a kill -9 ...
    assert any(e.name.startswith("awm-code-") for e in left.iterdir())
    assert any(e.name.startswith("actionopd-mcp-") for e in left.iterdir())
    # ... until the next process makes its own scratch dir (its first server or episode)
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                    "from actionopd_jax.envs.scratch import scratch_dir; scratch_dir()", str(Path(__file__).parents[1])],
                   env={**os.environ, "TMPDIR": str(tmp_path)}, check=True, timeout=60)
    assert not left.exists()


def test_heldout_split_is_a_hash_rule_of_the_ids_alone():
    from actionopd_jax.envs.admission import heldout_split

    ids = sorted(TASKS)
    # sha256 order of the 15 ids starts gym_classes_3/1 (0e3e..), bike_rental_4/1 (1624..),
    # recipe_box_2/2 (1821..), gym_classes_3/0 (1a6b..)
    assert heldout_split(ids, 0.25) == ["bike_rental_4/1", "gym_classes_3/1", "recipe_box_2/2"]  # floor(15/4) = 3
    assert heldout_split(list(reversed(ids)), 0.25) == heldout_split(ids, 0.25)  # order of the input is irrelevant
    assert heldout_split(ids, 0.01) == ["gym_classes_3/1"]  # at least one when the fraction is > 0
    assert heldout_split(ids, 0.0) == [] and heldout_split([], 0.5) == []
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        heldout_split(ids, 1.0)
