"""AWM / EnvScaler pools on our mini datasets (tests/data/awm_mini, envscaler_mini): loaders,
the initial-DB cache with per-episode copies, verifier verdicts for scripted final states, the
sandbox contract and the with-replacement mixture (the admission audit: test_env_pools_audit.py)."""

from __future__ import annotations

import collections
import json
import os
import re
import sqlite3
from pathlib import Path

import pytest

from actionopd_jax.envs.awm import db as awm_db
from actionopd_jax.envs.awm.layout import initial_messages as awm_messages
from actionopd_jax.envs.awm.layout import load_awm, normalize_name
from actionopd_jax.envs.awm.verify import parse_judge_reply, verify_code, verify_sql
from actionopd_jax.envs.envscaler.check import ClassEpisode, score_state
from actionopd_jax.envs.envscaler.layout import initial_messages as es_messages
from actionopd_jax.envs.envscaler.layout import load_envscaler
from actionopd_jax.envs.mixture import MixtureStream, parse_mixture, scale_counts
from actionopd_jax.envs.sandbox import Sandbox, SandboxError, SubprocessSandbox
from actionopd_jax.types import Task

DATA = Path(__file__).parent / "data"
AWM, ES = DATA / "awm_mini", DATA / "envscaler_mini"


@pytest.fixture(scope="module")
def sandbox():
    return SubprocessSandbox()


# --- loaders ------------------------------------------------------------------------------


def test_awm_loader_reads_the_published_layout():
    data = load_awm(AWM)
    assert data.missing_files == []
    assert sorted(data.scenarios) == ["bike_rental_4", "gym_classes_3", "library_loans_1", "recipe_box_2"]
    tasks = data.tasks()
    assert len(tasks) == 15 and len({t.task_id for t in tasks}) == 15
    assert tasks[0].task_id == "library_loans_1/0" and tasks[0].env == "awm"
    assert normalize_name("E-Commerce  Shop 33") == "e_commerce_shop_33"
    for sc in data.scenarios.values():
        names = [t["function"]["name"] for t in sc.tool_schemas()]
        # the spec's tools are the ones the generated server registers (MCP tool names, or the
        # FastAPI operation ids of the published form)
        assert sorted(names) == sorted(re.findall(r'(?:@mcp\.tool\(name|operation_id)="(\w+)"', sc.server_code))
        assert all(t["function"]["parameters"]["type"] == "object" for t in sc.tool_schemas())
        assert len(sc.verifiers["code"]) + len(sc.verifiers["sql"]) >= len(sc.tasks)
    borrow = data.scenarios["library_loans_1"].tool_schemas()[1]["function"]
    assert borrow["name"] == "borrow_book" and borrow["parameters"]["properties"]["book_id"]["type"] == "integer"
    assert borrow["parameters"]["required"] == ["book_id"]
    assert data.scenarios["recipe_box_2"].verifier(3, "sql")["function_name"] == "verify_task"
    msgs = awm_messages(tasks[0])
    assert [m["role"] for m in msgs] == ["system", "user"] and msgs[1]["content"] == tasks[0].payload["task"]
    assert "verification" not in json.dumps(tasks[0].payload)  # verifiers stay out of the task payload


def test_envscaler_loader_reads_classes_as_code_and_marks_conversational_tasks():
    data = load_envscaler(ES)
    assert sorted(data.envs) == ["env_1", "env_2"] and len(data.scenarios) == 6
    assert all(isinstance(e.class_code, str) and f"class {e.class_name}" in e.class_code for e in data.envs.values())
    tasks = data.tasks()
    conv = [t.task_id for t in tasks if t.payload["conversational"]]
    assert conv == ["mini_clinic_3"]
    assert load_envscaler(ES, conversational=["mini_locker_1"]).scenarios["mini_locker_1"].conversational
    t = tasks[0]
    assert [x["function"]["name"] for x in t.payload["tools"]][:2] == ["list_parcels", "list_free_lockers"]
    sys_msg = es_messages(t)[0]["content"]
    assert "parcel lockers" in sys_msg and "A locker holds at most one parcel." in sys_msg


# --- DB cache and per-episode copies --------------------------------------------------------


def test_initial_db_is_built_once_and_each_episode_gets_a_file_copy(tmp_path):
    sc = load_awm(AWM).scenarios["library_loans_1"]
    cache = awm_db.DbCache(tmp_path / "cache")
    before = awm_db.BUILDS["count"]
    first = cache.initial(sc)
    assert awm_db.BUILDS["count"] == before + 1
    assert awm_db.table_counts(first) == {"books": 4, "loans": 2, "members": 2}
    assert cache.report(sc).failed == 0 and (first.stat().st_mode & 0o222) == 0  # the cache is read-only
    copies = [cache.episode_copy(sc, tmp_path / f"ep{i}") for i in range(5)]
    again = awm_db.DbCache(tmp_path / "cache")  # a second process: finds the file, builds nothing
    assert again.initial(sc) == first and again.report(sc).statements == cache.report(sc).statements
    assert awm_db.BUILDS["count"] == before + 1  # inserts were not re-run for any episode
    con = sqlite3.connect(copies[0])
    con.execute("DELETE FROM loans")
    con.commit()
    con.close()
    assert awm_db.table_counts(copies[0])["loans"] == 0
    assert awm_db.table_counts(copies[1])["loans"] == 2 and awm_db.table_counts(first)["loans"] == 2


def test_a_failing_statement_is_counted_not_fatal(tmp_path):
    sc = load_awm(AWM).scenarios["gym_classes_3"]
    sc.sample_data = json.loads(json.dumps(sc.sample_data))
    sc.sample_data["tables"][0]["insert_statements"].append("INSERT INTO nowhere VALUES (1);")
    report = awm_db.DbCache(tmp_path).report(sc)
    assert report.failed == 1 and "nowhere" in report.errors[0]


# --- verifiers on scripted final states -------------------------------------------------------


def _episode(tmp_path, scenario, sql=()):
    cache = awm_db.DbCache(tmp_path / "cache")
    sc = load_awm(AWM).scenarios[scenario]
    path = cache.episode_copy(sc, tmp_path / "episode")
    con = sqlite3.connect(path)
    for stmt in sql:
        con.execute(stmt)
    con.commit()
    con.close()
    return sc, cache.initial(sc), path


BORROW_SALT = ["UPDATE books SET copies_available = 0 WHERE id = 2",
               "INSERT INTO loans (member_id, book_id, returned) VALUES (1, 2, 0)"]


def test_code_verifier_scores_a_correct_and_a_wrong_final_state(tmp_path, sandbox):
    sc, initial, final = _episode(tmp_path / "ok", "library_loans_1", BORROW_SALT)
    v = verify_code(sc.verifier(0, "code"), initial, final, sandbox=sandbox)
    assert v.verdict == "complete" and v.success and v.reward == 1.0
    sc, initial, wrong = _episode(tmp_path / "bad", "library_loans_1",
                                  ["INSERT INTO loans (member_id, book_id, returned) VALUES (1, 1, 0)"])
    v = verify_code(sc.verifier(0, "code"), initial, wrong, sandbox=sandbox)
    assert v.verdict == "others" and v.reward == 0.0
    # a read-only task is judged on the final answer
    sc, initial, same = _episode(tmp_path / "q", "library_loans_1")
    entry = sc.verifier(3, "code")
    assert verify_code(entry, initial, same, sandbox=sandbox, final_answer="You can borrow 3 copies.").success
    assert not verify_code(entry, initial, same, sandbox=sandbox, final_answer="Two copies.").success
    # the verifier gets read-only copies: the episode database is unchanged by verification
    assert awm_db.table_counts(final)["loans"] == 3


def test_broken_or_hanging_verifiers_are_judge_errors(tmp_path, sandbox):
    _, initial, final = _episode(tmp_path, "gym_classes_3")
    boom = {"code": "def verify_task_completion(initial_db_path, final_db_path):\n    raise KeyError('x')\n",
            "function_name": "verify_task_completion"}
    assert verify_code(boom, initial, final, sandbox=sandbox).verdict == "judge_error"
    shape = {"code": "def verify_task_completion(initial_db_path, final_db_path):\n    return 'complete'\n",
             "function_name": "verify_task_completion"}
    assert verify_code(shape, initial, final, sandbox=sandbox).verdict == "judge_error"
    hang = {"code": "import time\ndef verify_task_completion(initial_db_path, final_db_path):\n    time.sleep(30)\n",
            "function_name": "verify_task_completion"}
    v = verify_code(hang, initial, final, sandbox=sandbox, timeout_s=0.5)
    assert v.verdict == "judge_error" and "timeout" in v.details["error"]


def test_sql_verifier_facts_go_to_the_judge_callable(tmp_path, sandbox):
    sc, initial, final = _episode(tmp_path, "recipe_box_2", ["INSERT INTO favorites (user_id, recipe_id) VALUES (1, 2)"])
    seen = []

    def judge(messages):
        seen.append(messages)
        facts = json.loads(messages[1]["content"])["check_output"]
        done = facts["quickest_japanese_recipe"] in facts["favourite_titles"]
        return json.dumps({"classification": "complete" if done else "incomplete", "reasoning": "."})

    entry = sc.verifier(3, "sql")
    trajectory = [{"role": "assistant", "tool_call": {"name": "add_favorite", "arguments": {"recipe_id": 2}}}]
    v = verify_sql(entry, sc.tasks[3], initial, final, sandbox=sandbox, judge=judge, trajectory=trajectory)
    assert v.verdict == "complete" and sorted(v.details["facts"]["favourite_titles"]) == ["Miso Glazed Aubergine", "Slow Ragu"]
    assert "success_criteria" in seen[0][1]["content"] and "add_favorite" in seen[0][1]["content"]
    v = verify_sql(entry, sc.tasks[3], initial, initial, sandbox=sandbox, judge=judge)
    assert v.verdict == "incomplete" and not v.success

    def down(messages):
        raise ConnectionError("judge endpoint down")

    assert verify_sql(entry, sc.tasks[3], initial, final, sandbox=sandbox, judge=down).verdict == "judge_error"
    assert parse_judge_reply("sure! {\"classification\": \"agent_error\"}")[0] == "agent_error"
    assert parse_judge_reply("no json here")[0] == "judge_error"
    assert parse_judge_reply('{"classification": "great"}')[0] == "judge_error"


# --- EnvScaler episodes and checks ------------------------------------------------------------


def test_envscaler_checks_score_scripted_episodes(sandbox):
    data = load_envscaler(ES)
    sc = data.scenarios["mini_locker_1"]
    ep = ClassEpisode(data.envs[sc.env_id], sc, sandbox=sandbox)
    assert "L1" in ep.call("list_free_lockers", {"site": "Harbour St"})
    assert "True" in ep.call("assign_parcel", {"parcel_id": "P7", "locker_id": "L1"})
    assert "occupied" in ep.call("assign_parcel", {"parcel_id": "P8", "locker_id": "L1"})  # state persists
    assert ep.call("__init__", {}).startswith("Error")
    out = ep.finish()
    assert out.success and out.reward == 1.0
    ep = ClassEpisode(data.envs[sc.env_id], sc, sandbox=sandbox)
    ep.call("assign_parcel", {"parcel_id": "P7", "locker_id": "L3"})  # wrong site
    out = ep.finish()
    assert not out.success and out.reward == 0.0
    conv = data.scenarios["mini_clinic_3"]
    ep = ClassEpisode(data.envs[conv.env_id], conv, sandbox=sandbox)
    ep.call("book_slot", {"slot_id": "S1", "patient": "Lena Roth"})  # half of the task
    out = ep.finish()
    assert out.reward == 0.5 and not out.success
    state = {"x": 1}
    bad = type(conv)(**{**conv.__dict__, "checks": [{"check_item": "?", "check_func": "def check_func(s):\n    return 1\n"}]})
    assert score_state(bad, state, state, sandbox=sandbox).errors


def test_sandbox_scrubs_secrets_and_contains_prints(sandbox, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    assert isinstance(sandbox, Sandbox)
    code = "import os\ndef f():\n    print('x' * 100000)\n    return os.environ.get('OPENAI_API_KEY', 'absent'), os.getcwd()\n"
    res = sandbox.run_function(code, "f", {})
    assert res.ok and res.value[0] == "absent" and res.value[1] != os.getcwd()
    with pytest.raises(SandboxError, match="not found"):
        sandbox.open_class("class A:\n    pass\n", "B", {})
    flood = sandbox.run_function("def f():\n    for _ in range(20000):\n        print('y' * 1000)\n", "f", {})
    assert not flood.ok and "File too large" in flood.error and len(flood.stderr_tail) <= 2000


# --- the mixture ------------------------------------------------------------------------------


def _pool(name, n):
    return [Task(task_id=f"{name}{i}", env={"a": "awm", "e": "envscaler"}[name]) for i in range(n)]


def test_mixture_counts_replacement_seeding_and_resume():
    def make(seed=7):
        return MixtureStream([("awm", _pool("a", 40), 59), ("envscaler", _pool("e", 3), 5)], seed=seed)

    s = make()
    steps = [s.next_step() for _ in range(6)]
    for step in steps:
        assert collections.Counter(t.env for t in step) == {"awm": 59, "envscaler": 5}
        assert [t.env for t in step] == ["awm"] * 59 + ["envscaler"] * 5
    # with replacement: 5 draws from 3 tasks repeat, and 59 from 40 do too
    assert all(len({t.task_id for t in st[59:]}) < 5 for st in steps)
    assert all(len({t.task_id for t in st[:59]}) < 59 for st in steps)
    assert [t.task_id for t in make().next_step()] == [t.task_id for t in steps[0]]
    assert [t.task_id for t in make(8).next_step()] != [t.task_id for t in steps[0]]
    # resume: the state after 3 steps (and mid-step) continues exactly
    r = make()
    for _ in range(3):
        r.next_step()
    r.next_task()
    state = json.loads(json.dumps(r.state_dict()))
    fresh = make()
    fresh.load_state_dict(state)
    assert [t.task_id for t in fresh.next_step()] == [t.task_id for t in r.next_step()]
    assert fresh.get_state() == r.get_state()
    with pytest.raises(ValueError, match="different configuration"):
        make(9).set_state(state)
    other = MixtureStream([("awm", _pool("a", 41), 59), ("envscaler", _pool("e", 3), 5)], seed=7)
    with pytest.raises(ValueError, match="different configuration"):
        other.set_state(state)


def test_mixture_parsing_scaling_and_config(tmp_path):
    from actionopd_jax.config import ConfigError
    from actionopd_jax.config.load import load_config
    from actionopd_jax.envs.task_sets import task_stream_from, training_tasks_summary

    assert parse_mixture(["awm:59", "envscaler:5"]) == [("awm", 59), ("envscaler", 5)]
    for bad in (["awm"], ["bfcl:3"], ["awm:x"], ["awm:0"], ["awm:1", "awm:2"]):
        with pytest.raises(ValueError):
            parse_mixture(bad)
    assert scale_counts([59, 5], 64) == [59, 5] and scale_counts([59, 5], 1) == [1, 0]
    assert scale_counts([59, 5], 16) == [15, 1] and sum(scale_counts([3, 3, 1], 10)) == 10
    base = ["env.name=awm", f"env.awm_dir={AWM}", f"env.envscaler_dir={ES}", "env.mixture=[awm:59, envscaler:5]"]
    with pytest.raises(ConfigError, match="env.envscaler_dir"):
        load_config(None, ["env.name=awm", f"env.awm_dir={AWM}", "env.mixture=awm:59,envscaler:5"])
    with pytest.raises(ConfigError, match="env.mixture entry"):
        load_config(None, ["env.name=awm", f"env.awm_dir={AWM}", "env.mixture=[awm:-1]"])
    with pytest.raises(ConfigError, match="env.manifest"):
        task_stream_from(load_config(None, base).env, per_step=64, seed=0)
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"pools": {
        "awm": {"admitted": ["library_loans_1/0", "recipe_box_2/1", "gym_classes_3/2"]},
        "envscaler": {"admitted": ["mini_clinic_3"]}}}))
    cfg = load_config(None, base + [f"env.manifest={manifest}"])
    stream = task_stream_from(cfg.env, per_step=64, seed=0)
    step = stream.next_step()
    assert len(step) == 64 and {t.task_id for t in step[59:]} == {"mini_clinic_3"}
    assert {t.task_id for t in step[:59]} <= {"library_loans_1/0", "recipe_box_2/1", "gym_classes_3/2"}
    assert "awm 3 admitted (59/step), envscaler 1 admitted (5/step)" in training_tasks_summary(cfg.env, needed_by="t")
