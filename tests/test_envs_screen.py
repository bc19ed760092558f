"""`actionopd envs screen` (paper B.1's static feasibility screen) against a judge served over real
HTTP on loopback by the project's OpenAI-compatible server, through the real `openai` client.

The scripted judge reads the evidence it is shown, as a real one would: a goal that asks for an
operation no tool offers ("fax") is infeasible, and so is a verifier that checks for a record id
the initial data does not hold. We plant one of each in a copy of the mini AWM pool and one
"fax" goal in the mini EnvScaler pool; one task's judge reply is garbled once (asked again), one
always (recorded as an error, not admitted, asked again on the next run).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from actionopd_jax.commands.main import main
from actionopd_jax.envs.admission import read_manifest
from actionopd_jax.envs.awm.layout import load_awm
from actionopd_jax.envs.screen_manifest import SCREEN_STAGE, apply_screening
from actionopd_jax.envs.task_sources import SECTIONS, awm_sources
from actionopd_jax.screening.prompt import _fit, build_prompt, parse_reply
from actionopd_jax.serve.faults import FaultInjector, FaultRates
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice

DATA = Path(__file__).parent / "data"
JUDGE = "screen-judge"
FAX_AWM, FAX_ES = "library_loans_1/3", "mini_locker_3"
BAD_VERIFIER = "recipe_box_2/0"
GARBLED_ONCE, GARBLED_ALWAYS = "bike_rental_4/0", "bike_rental_4/1"


def _section(prompt: str, heading: str) -> str:
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=\n## |\Z)", prompt, re.M | re.S)
    assert m, f"the prompt has no section {heading!r}"
    return m.group(1)


class Judge:
    """The scripted judge: verdicts from the evidence, garbling as told, every request kept."""

    def __init__(self):
        self.garble_always = {GARBLED_ALWAYS}
        self.asked: list[str] = []

    def reply(self, req):
        prompt = req.messages[1]["content"]
        tid = re.search(r"^## Task goal \(\w+ task (.+?)\)$", prompt, re.M).group(1)
        self.asked.append(tid)
        retry = len(req.messages) > 2
        if tid in self.garble_always or (tid == GARBLED_ONCE and not retry):
            return message_choice("It looks fine to me.")
        goal = re.search(r"^## Task goal .*?\n(.*?)(?=\n## )", prompt, re.S).group(1)
        tools = _section(prompt, SECTIONS["tools"])
        data = _section(prompt, SECTIONS["initial_data"])
        verifier = _section(prompt, SECTIONS["verifier"])
        missing = [n for n in re.findall(r"recipe_id = (\d+)", verifier) if f"VALUES ({n}," not in data]
        if "fax" in goal.lower() and "fax" not in tools.lower():
            verdict, reason = "infeasible", "no tool can send a fax"
        elif missing:
            verdict, reason = "infeasible", f"the verifier needs recipe {missing[0]}, which the data does not hold"
        else:
            verdict, reason = "feasible", "the tools and data support the goal"
        body = json.dumps({"verdict": verdict, "reason": reason, "confidence": 0.9})
        return message_choice(f"<think>checking</think>\n```json\n{body}\n```")


@pytest.fixture
def judge():
    j = Judge()
    server = OpenAIServer(ScriptedBackend(JUDGE, j.reply))
    server.start()
    try:
        yield j, server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from actionopd_jax.chat.tiny_tokenizer import build_tiny_tokenizer

    return str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny"))


def _edit_jsonl(path: Path, edit) -> None:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    path.write_text("".join(json.dumps(edit(r)) + "\n" for r in rows))


def _planted_awm(root: Path) -> Path:
    shutil.copytree(DATA / "awm_mini", root)

    def tasks(r):
        if r["scenario"] == "library_loans_1":
            r["tasks"][3] = "Fax my current loans to the branch office at 555-0100."
        return r

    def verifier(r):
        if r["scenario"] == "recipe_box_2" and r["task_idx"] == 0:
            r["verification"]["code"] = r["verification"]["code"].replace("recipe_id = 3", "recipe_id = 99")
        return r

    _edit_jsonl(root / "gen_tasks.jsonl", tasks)
    _edit_jsonl(root / "gen_verifier.pure_code.jsonl", verifier)
    return root


def _screen(server, manifest: Path, env: str = "awm", *extra: str) -> int:
    return main(["envs", "screen", "--env", env, "--manifest", str(manifest), "--judge-url", server.base_url,
                 "--judge-model", JUDGE, *extra])


def test_screen_rejects_planted_tasks_records_them_and_never_asks_twice(tmp_path, judge, tok_dir, capsys):
    j, server = judge
    root = _planted_awm(tmp_path / "awm")
    manifest = tmp_path / "out" / "pools.json"
    assert main(["envs", "audit", "--env", "awm", "--dir", str(root), "--manifest", str(manifest),
                 "--tokenizer", tok_dir, "--heldout-fraction", "0.25"]) == 0
    audited = read_manifest(manifest)["pools"]["awm"]
    assert len(audited["admitted"]) == 15 and len(audited["source_hashes"]) == 15
    capsys.readouterr()

    # run 1: 15 tasks; one garbled reply asked again (2 requests), one never parses (3): 18 requests
    assert _screen(server, manifest) == 1
    out, err = capsys.readouterr()
    assert server.request_count == 18 and sorted(set(j.asked)) == sorted(audited["admitted"])
    assert "| 15 | 0 | 15 | 0 | 12 | 2 | 1 | 18 |" in out
    assert f"| {FAX_AWM} | infeasible | no tool can send a fax |" in out
    assert "screened 15/15 (cached 0, asked 15; feasible 12, rejected 2, errors 1)" in err
    assert (tmp_path / "out" / "screen_cache.sqlite").is_file()  # beside --manifest, not in the pool dir
    assert not (root / "admitted.json").exists() and not (root / "screen_cache.sqlite").exists()
    entry = read_manifest(manifest)["pools"]["awm"]
    recs = entry["screening"]["records"]
    assert recs[FAX_AWM]["verdict"] == recs[BAD_VERIFIER]["verdict"] == "infeasible"
    assert recs[BAD_VERIFIER]["reason"] == "the verifier needs recipe 99, which the data does not hold"
    assert recs[GARBLED_ONCE]["verdict"] == "feasible" and recs[GARBLED_ONCE]["requests"] == 2
    assert recs[GARBLED_ALWAYS]["verdict"] == "error" and recs[GARBLED_ALWAYS]["reason"].startswith("format:")
    for tid, r in recs.items():
        assert r["model"] == JUDGE and r["source_hash"] == entry["source_hashes"][tid] and r["time"]
        assert r["confidence"] == (None if tid == GARBLED_ALWAYS else 0.9)
    rejected = {FAX_AWM, BAD_VERIFIER, GARBLED_ALWAYS}
    assert set(entry["admitted"]) == set(entry["audited"]) - rejected
    assert entry["dropped"][FAX_AWM] == "infeasible: no tool can send a fax"
    assert entry["dropped"][GARBLED_ALWAYS].startswith("screen error: format:")
    assert entry["funnel"][-1]["kept"] == 12 and not set(entry["heldout"]) & rejected
    assert set(entry["heldout"]) == set(entry["audited_heldout"]) - rejected

    # run 2: only the task without a verdict is asked (the judge answers it now)
    j.garble_always.clear()
    assert _screen(server, manifest) == 0 and server.request_count == 19 and j.asked[-1] == GARBLED_ALWAYS
    # run 3: everything cached, no request; the records (their times included) are unchanged
    before = read_manifest(manifest)["pools"]["awm"]["screening"]["records"]
    capsys.readouterr()
    assert _screen(server, manifest) == 0 and server.request_count == 19
    assert "| 15 | 15 | 0 | 0 | 13 | 2 | 0 | 0 |" in capsys.readouterr().out
    entry = read_manifest(manifest)["pools"]["awm"]
    assert entry["screening"]["records"] == before and len(entry["admitted"]) == 13

    # a changed source (the verifier of one task) is asked again, alone
    _edit_jsonl(root / "gen_verifier.pure_code.jsonl", lambda r: (
        r | {"verification": r["verification"] | {"code": r["verification"]["code"] + "# v2\n"}}
        if (r["scenario"], r["task_idx"]) == ("gym_classes_3", 0) else r))
    assert _screen(server, manifest) == 0 and server.request_count == 20 and j.asked[-1] == "gym_classes_3/0"
    assert "| 15 | 14 | 1 | 1 | 13 | 2 | 0 | 1 |" in capsys.readouterr().out

    # a re-audit keeps the screen's verdicts: the rejected tasks stay out of training
    assert main(["envs", "audit", "--env", "awm", "--dir", str(root), "--manifest", str(manifest),
                 "--tokenizer", tok_dir, "--heldout-fraction", "0.25"]) == 0
    m = read_manifest(manifest)
    assert m["admitted"]["awm"] == set(entry["audited"]) - {FAX_AWM, BAD_VERIFIER}
    assert "admitted 13 of 15 tasks" in capsys.readouterr().out and server.request_count == 20
    # and training draws from the screened tasks only, never the held-out ones
    from actionopd_jax.config import EnvConfig
    from actionopd_jax.envs.mixture import mixture_pool_tasks

    pools = mixture_pool_tasks(EnvConfig(name="awm", awm_dir=str(root), manifest=str(manifest)))
    drawn = {t.task_id for t in pools["awm"]}
    assert drawn == m["admitted"]["awm"] - m["heldout"]["awm"] and len(m["heldout"]["awm"]) == 3


def test_envscaler_screen_and_the_prompt_it_sends(tmp_path, judge, tok_dir, capsys):
    j, server = judge
    root = tmp_path / "es"
    shutil.copytree(DATA / "envscaler_mini", root)
    items = json.loads((root / "rl_scenario_metadata.json").read_text())
    next(i for i in items if i["task_id"] == FAX_ES)["task"] = "Fax Nora Quist a list of her waiting parcels."
    (root / "rl_scenario_metadata.json").write_text(json.dumps(items))
    manifest = tmp_path / "pools.json"
    assert main(["envs", "audit", "--env", "envscaler", "--dir", str(root), "--manifest", str(manifest),
                 "--tokenizer", tok_dir]) == 0
    assert _screen(server, manifest, "envscaler") == 0 and server.request_count == 6
    entry = read_manifest(manifest)["pools"]["envscaler"]
    assert entry["dropped"] == {FAX_ES: "infeasible: no tool can send a fax"} and len(entry["admitted"]) == 5
    # what the judge was shown: the goal, then the five evidence sections with the pool's own content
    prompt = next(r.messages[1]["content"] for r in server.backends[JUDGE].requests
                  if f"task {FAX_ES})" in r.messages[1]["content"])
    heads = re.findall(r"^## (.+)$", prompt, re.M)
    assert heads == [f"Task goal (envscaler task {FAX_ES})", *SECTIONS.values()]
    assert "class ParcelLockerSystem" in prompt and "def check_func(final_state)" in prompt
    assert '"Harbour St"' in prompt and "reference_actions" not in prompt and "assign_parcel" in prompt


def test_prompt_budget_cuts_the_largest_sections_and_the_hash_covers_them_whole():
    data = load_awm(DATA / "awm_mini")
    tasks = data.tasks()
    src = awm_sources(data, tasks)["library_loans_1/0"]
    full, cut = build_prompt(src, 10**6)
    assert cut == [] and src.sections["implementation"] in full and "Salt and Stars" in full
    # sections under an even share keep all; the rest share what is left: 100 | 1000 | 1000
    assert _fit({"a": 100, "b": 1000, "c": 5000}, 2100) == {"a": 100, "b": 1000, "c": 1000}
    small, cut = build_prompt(src, 3000)
    assert "implementation" in cut and "characters cut]" in small and src.goal in small  # the goal is never cut
    removed = sum(map(int, re.findall(r"\[\.\.\. (\d+) characters cut\]", small)))
    shown = sum(len(t) for t in src.sections.values()) - removed
    assert 3000 - len(SECTIONS) < shown <= 3000  # even shares are rounded down
    other = awm_sources(data, tasks)["library_loans_1/0"]
    assert other.source_hash == src.source_hash and len(src.source_hash) == 64
    # the verifier is part of the source: the same task with its sql verifier hashes differently
    assert awm_sources(data, tasks, {"library_loans_1/0": "sql"})["library_loans_1/0"].source_hash != src.source_hash


@pytest.mark.parametrize("reply, expected", [
    ('{"verdict": "feasible", "reason": "ok", "confidence": 0.7}', ("feasible", "ok", 0.7)),
    ('<think>{"verdict": "infeasible"}</think>Sure.\n```json\n{"verdict": "Infeasible", "reason": "no tool"}\n```',
     ("infeasible", "no tool", None)),
    ('{"verdict": "feasible", "reason": "ok", "confidence": 7}', ("feasible", "ok", None)),  # diagnostic only
    ('{"verdict": "feasible", "reason": "ok", "confidence": true}', ("feasible", "ok", None)),
    ('{"verdict": "probably", "reason": "ok"}', None),
    ('{"verdict": "feasible", "reason": "  "}', None),
    ('{"verdict": "feasible", "reason": "a"} {"verdict": "infeasible", "reason": "b"}', None),
    ("VERDICT: feasible", None),
    ('{"verdict": "feasible", "reason": "cut', None),
    (None, None),
])
def test_reply_parser(reply, expected):
    got = parse_reply(reply)
    assert (None if got is None else (got.verdict, got.reason, got.confidence)) == expected


def test_bad_input_is_refused_in_one_paragraph(tmp_path, judge, capsys, monkeypatch):
    _, server = judge
    missing = tmp_path / "none.json"
    assert _screen(server, missing) == 2
    assert "no manifest at" in capsys.readouterr().err
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"pools": {"envscaler": {"admitted": [], "dir": str(DATA / "envscaler_mini")}}}))
    assert _screen(server, manifest) == 2
    assert "has no audited awm pool" in capsys.readouterr().err
    manifest.write_text(json.dumps({"pools": {"awm": {"admitted": ["nope/0"], "dir": str(DATA / "awm_mini")}}}))
    assert _screen(server, manifest) == 2
    assert "does not hold (e.g. ['nope/0'])" in capsys.readouterr().err
    one = {"pools": {"awm": {"admitted": ["library_loans_1/0"], "dir": str(DATA / "awm_mini")}}}
    manifest.write_text(json.dumps(one))
    monkeypatch.delenv("SCREEN_TEST_KEY", raising=False)
    assert _screen(server, manifest, "awm", "--judge-api-key-env", "SCREEN_TEST_KEY") == 2
    err = capsys.readouterr().err
    assert "'SCREEN_TEST_KEY' is not set" in err and "Traceback" not in err
    assert server.request_count == 0 and json.loads(manifest.read_text()) == one  # nothing sent, nothing lost


def test_a_failing_endpoint_stops_the_screen_and_admits_nothing_unjudged(tmp_path, capsys):
    """A wrong model name is a 404 for every task: after --stop-after-errors of them in a row the
    other tasks are not sent; every task is recorded as an error and none is admitted."""
    counter = FaultInjector(FaultRates(), seed=0)  # no faults: it counts the requests that arrive
    server = OpenAIServer(ScriptedBackend(JUDGE, Judge().reply), middleware=counter)
    server.start()
    try:
        _failing_endpoint(tmp_path, server, counter, capsys)
    finally:
        server.stop()


def _failing_endpoint(tmp_path, server, counter, capsys):
    ids = [t.task_id for t in load_awm(DATA / "awm_mini").tasks()]
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"pools": {"awm": {"admitted": ids, "dir": str(DATA / "awm_mini")}}}))
    assert main(["envs", "screen", "--env", "awm", "--manifest", str(manifest), "--judge-url", server.base_url,
                 "--judge-model", "no-such-model", "--concurrency", "1", "--stop-after-errors", "3"]) == 1
    assert counter.requests_seen == 3 and server.request_count == 0  # 404s: no backend was reached
    out, err = capsys.readouterr()
    assert "15 task(s) got no verdict" in err and "Traceback" not in err
    assert "| 15 | 0 | 3 | 0 | 0 | 0 | 15 | 3 |" in out  # 3 tasks sent, 12 left unsent
    entry = read_manifest(manifest)["pools"]["awm"]
    reasons = [entry["screening"]["records"][t]["reason"] for t in ids]
    assert [r.startswith("api: HTTP 404") for r in reasons] == [True] * 3 + [False] * 12
    assert all(r.startswith("not asked: the endpoint failed 3 times in a row") for r in reasons[3:])
    assert entry["admitted"] == [] and entry["audited"] == ids


def test_apply_screening_is_idempotent_and_admits_only_current_feasible_verdicts():
    rec = lambda v, h: {"verdict": v, "reason": f"r-{v}", "source_hash": h}  # noqa: E731
    entry = {"admitted": ["a", "b", "c", "d", "e"], "heldout": ["a", "b"], "dropped": {"z": "no verifier"},
             "funnel": [{"stage": "tasks in the directory", "kept": 6, "reasons": {}}],
             "source_hashes": {"a": "ha", "b": "hb", "c": "hc2", "d": "hd", "e": "he"},
             "screening": {"records": {"a": rec("feasible", "ha"), "b": rec("infeasible", "hb"),
                                       "c": rec("feasible", "hc1"), "d": rec("error", "hd")}}}
    apply_screening(entry)
    assert entry["admitted"] == ["a"] and entry["heldout"] == ["a"] and entry["audited_heldout"] == ["a", "b"]
    assert entry["dropped"] == {"z": "no verifier", "b": "infeasible: r-infeasible",
                                "c": "not screened since its source changed (run `actionopd envs screen`)",
                                "d": "screen error: r-error", "e": "not screened (run `actionopd envs screen`)"}
    assert entry["funnel"][-1] == {"stage": SCREEN_STAGE, "kept": 1, "note": "confidence recorded, not a threshold",
                                   "reasons": {"judged infeasible": 1, "not screened": 2,
                                               "no verdict (screen error)": 1}}
    # b is judged again, feasible now: it comes back, into the held-out split it was drawn for
    entry["screening"]["records"]["b"] = rec("feasible", "hb")
    apply_screening(entry)
    apply_screening(entry)
    assert entry["admitted"] == ["a", "b"] and entry["heldout"] == ["a", "b"] and len(entry["funnel"]) == 2
    assert set(entry["dropped"]) == {"z", "c", "d", "e"}


PAPER_RECIPE = Path(__file__).parents[1] / "configs" / "paper" / "qwen3_4b_tpu.yaml"


def _paper_env(root: Path, manifest: Path, *extra: str):
    from actionopd_jax.config.load import load_config

    return load_config(PAPER_RECIPE, [f"env.awm_dir={root}", f"env.manifest={manifest}", "env.mixture=[awm:3]",
                                      *extra]).env


def test_a_paper_recipe_refuses_a_pool_without_current_screening_records(tmp_path, caplog):
    """Issue 43 item 5: the paper's B.1 screen cannot be skipped by accident. A paper recipe
    (env.require_screening: true) refuses a pool whose manifest holds audit records only, and
    one whose records are stale (the task's source changed since the screen), naming `actionopd
    envs screen`; env.require_screening=false trains with a warning every run; records judged
    feasible on the current source let it train without one."""
    from actionopd_jax.config import ConfigError
    from actionopd_jax.envs.task_sets import task_stream_from, training_tasks_summary

    root = tmp_path / "awm"
    shutil.copytree(DATA / "awm_mini", root)
    ids = ["library_loans_1/0", "recipe_box_2/0", "bike_rental_4/0"]
    manifest = tmp_path / "m.json"
    entry = {"pool": "awm", "dir": str(root), "admitted": ids, "heldout": []}
    manifest.write_text(json.dumps({"pools": {"awm": entry}}))

    env = _paper_env(root, manifest)
    assert env.require_screening is True
    for attempt in (lambda: training_tasks_summary(env, needed_by="x"),
                    lambda: task_stream_from(env, per_step=3, seed=0)):
        with pytest.raises(ConfigError, match=r"env.require_screening: pool 'awm': 3 of its 3 training tasks have no "
                                              r"current B.1 feasibility-screen record .*3 not screened.*"
                                              r"actionopd envs screen --env awm"):
            attempt()

    # the explicit way out: trains, and says so every run (the stream is built once per run)
    off = _paper_env(root, manifest, "env.require_screening=false")
    assert "warning: training on tasks the paper's B.1 feasibility screen has not kept (env.require_screening " \
           "is false)" in training_tasks_summary(off, needed_by="x")
    for _ in range(2):
        caplog.clear()
        task_stream_from(off, per_step=3, seed=0)
        assert any("B.1 feasibility screen has not kept" in r.getMessage() for r in caplog.records)

    # screened: every training task judged feasible on the source the pool holds today
    data = load_awm(root)
    sources = awm_sources(data, [t for t in data.tasks() if t.task_id in ids])
    entry["screening"] = {"records": {t: {"verdict": "feasible", "reason": "ok", "source_hash": s.source_hash}
                                      for t, s in sources.items()}}
    manifest.write_text(json.dumps({"pools": {"awm": entry}}))
    summary = training_tasks_summary(env, needed_by="x")
    assert "warning" not in summary and "awm 3 admitted" in summary
    caplog.clear()
    task_stream_from(env, per_step=3, seed=0)
    assert not [r for r in caplog.records if "B.1" in r.getMessage()]

    # the pool changed under the manifest: that task's record is stale, the recipe refuses again
    _edit_jsonl(root / "gen_tasks.jsonl", lambda r: {**r, "tasks": [r["tasks"][0] + " Today."] + r["tasks"][1:]}
                if r["scenario"] == "recipe_box_2" else r)
    with pytest.raises(ConfigError, match=r"1 of its 3 training tasks .*1 not screened since its source changed.*"
                                          r"recipe_box_2/0"):
        training_tasks_summary(env, needed_by="x")
