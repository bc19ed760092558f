"""`eval` writes each episode's conversation, verdict and reason (trajectories.jsonl), with the
call strings the official checker scored; and the one known difference from bfcl_eval's
executor (a call to a tool offered only in a later turn) reported next to our verdict."""

import asyncio
import json

from actionopd_jax.envs.registry import make_environment
from actionopd_jax.eval import cli as eval_cli
from actionopd_jax.eval.agents import ReferenceAgent
from actionopd_jax.eval.runner import load_finished, run_eval
from actionopd_jax.eval.tasks import select_tasks


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_eval_cli_writes_readable_trajectories_next_to_the_scores(tmp_path):
    out = tmp_path / "eval"
    assert eval_cli.main(["--reference", "--bench", "bfcl:base", "--limit", "2", "--out", str(out),
                          "--no-progress"]) == 0
    trajectories = _lines(out / "trajectories.jsonl")
    assert [t["task_id"] for t in trajectories] == [r["task_id"] for r in load_finished(out / "episodes.jsonl")]
    t = trajectories[0]
    assert t["verdict"] == {"reward": 1.0, "official": 1.0, "strict": 1.0} and t["reason"] == "completed"
    calls = [m for m in t["messages"] if m["role"] == "assistant" and m.get("tool_calls")]
    results = [m for m in t["messages"] if m["role"] == "tool"]
    assert calls and len(results) == sum(len(m["tool_calls"]) for m in calls)
    # the checker scored exactly the calls of the conversation, turn by turn
    scored = [c for turn in t["scored_calls"]["ours"] for step in turn for c in step]
    assert len(scored) == len(results) and t["scored_calls"]["bfcl_eval"] == t["scored_calls"]["ours"]
    assert "messages" not in load_finished(out / "episodes.jsonl")[0]  # the scores file stays compact


def test_a_later_turn_tool_is_refused_here_and_its_bfcl_eval_verdict_reported(tmp_path):
    """multi_turn_miss_func_49's ground truth calls `tail` in turn 1, a tool the task only offers
    from turn 3: refused here (tool error, official 0), run by bfcl_eval's executor (1)."""
    (task,) = [t for t in select_tasks("bfcl:miss_func") if t.task_id == "multi_turn_miss_func_49"]
    records, errors = asyncio.run(run_eval(ReferenceAgent(), [task], lambda t: make_environment(t.env),
                                           tmp_path / "ep.jsonl", progress=False,
                                           trajectories_jsonl=tmp_path / "tr.jsonl"))
    assert errors == []
    assert records[0]["score"]["official"] == 0.0 and records[0]["score"]["bfcl_eval_official"] == 1.0
    (t,) = _lines(tmp_path / "tr.jsonl")
    assert t["verdict"]["official"] == 0.0 and t["verdict"]["bfcl_eval_official"] == 1.0
    assert "execution_response_mismatch" in t["reason"]
    assert "tail(file_name='file3.txt')" in t["scored_calls"]["bfcl_eval"][1][1]
    assert all("tail(" not in c for step in t["scored_calls"]["ours"][1] for c in step)
    refused = [m for m in t["messages"] if m["role"] == "tool" and m["name"] == "tail"]
    assert refused and refused[0]["content"].startswith("Error during execution: Tool 'tail' is not available")


def test_resume_keeps_scores_and_trajectories_in_step(tmp_path):
    """A kill between the two writes leaves a trajectory whose episode has no score: it is
    dropped and the episode reruns, so each finished episode has exactly one trajectory."""
    tasks = select_tasks("bfcl:base", limit=2)
    ep, tr = tmp_path / "ep.jsonl", tmp_path / "tr.jsonl"
    asyncio.run(run_eval(ReferenceAgent(), tasks[:1], lambda t: make_environment(t.env), ep, progress=False,
                         trajectories_jsonl=tr))
    orphan = dict(_lines(tr)[0], task_id=tasks[1].task_id)
    with tr.open("a") as f:
        f.write(json.dumps(orphan) + "\n" + '{"task_id": "torn')
    asyncio.run(run_eval(ReferenceAgent(), tasks, lambda t: make_environment(t.env), ep, progress=False,
                         trajectories_jsonl=tr))
    got = _lines(tr)
    assert [t["task_id"] for t in got] == [t.task_id for t in tasks]
    assert got[1]["messages"] != orphan["messages"]  # rerun, not the stale copy


def test_tau2_trajectories_hold_the_user_simulator_turns(tmp_path):
    """tau2 through the same writer: the conversation includes the simulated user's turns (a
    scripted user on a real server) and the tool results of the agent's calls."""
    from actionopd_jax.envs.user_sim import UserSimConfig, UserSimulator
    from tests._envs_fixtures import USER_MODEL, start_user_server

    task = select_tasks("tau2_telecom:train", limit=1)[0]
    server, _ = start_user_server()
    try:
        sim = UserSimulator(UserSimConfig(base_url=server.base_url, model=USER_MODEL, max_retries=0))
        records, errors = asyncio.run(run_eval(ReferenceAgent(), [task],
                                               lambda t: make_environment(t.env, user_sim=sim),
                                               tmp_path / "ep.jsonl", progress=False,
                                               trajectories_jsonl=tmp_path / "tr.jsonl"))
    finally:
        server.stop()
    assert errors == [] and records[0]["score"]["reward"] == 1.0
    (t,) = _lines(tmp_path / "tr.jsonl")
    roles = {m["role"] for m in t["messages"]}
    assert {"user", "assistant", "tool"} <= roles and t["verdict"] == {"reward": 1.0}
    assert "scored_calls" not in t and t["reason"]
