"""The matcher audit (`actionopd audit-matcher`, issue 35 item 4), end to end over HTTP.

A real collection (the toy environment, our loopback server as teacher and run's judge, the
student's replies fixed texts) writes the judged-pair log; then the audit command asks a
second judge -- another model on the same loopback server -- about every logged pair. The two
judges disagree on purpose on exactly these pairs:

- decision 0 (teacher samples A=add(2,3), A, B=note("remember five")):
  * candidate 1 note("SAME remember five") vs B: the run's judge MATCH, the audit judge NO_MATCH;
  * candidate 0 = A vs A (twice): the rules match, the audit judge says NO_MATCH;
  * candidate 3 = B vs A (twice): different tools, the audit judge says MATCH;
- decision 1 (teacher samples "The answer is 6." x3):
  * candidate 2 "The answer is 5." (three pairs): the run's judge NO_MATCH, the audit judge MATCH.

Everything else agrees. With a census sample (--sample above the 24 pairs) every number below
is hand-computed: strata sizes, rates, the judges' 2x2 table [[6, 1], [3, 1]] and its kappa
(p_o = 7/11, p_e = (7*9 + 4*2)/121 = 71/121, kappa = 6/50 = 0.12), the flip shares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from actionopd_jax.commands.main import main as actionopd
from actionopd_jax.matching.audit import allocate, cohen_kappa, stratified_sample
from actionopd_jax.matching.judged_log import JudgedLog, read_judged, resolve_context
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.types import Message, ToolCall
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (A, B, FINAL, Script, collect_once, collector_config, fixed_text_sample_fn,
                                     make_collector, make_matcher, make_teacher, serve, teacher_backend, toy_task)

SAME_NOTE = ToolCall("note", {"text": "SAME remember five"})
NEAR_NOTE = ToolCall("note", {"text": "remember five!"})
SIX, FIVE, PLAIN = Message("The answer is six."), Message("The answer is 5."), Message("the answer is 6")
SCRIPT = Script(teacher={("plant", 0): [A, A, B], ("plant", 1): [FINAL] * 3},
                student={("plant", 0): [A, SAME_NOTE, NEAR_NOTE, B], ("plant", 1): [FINAL, SIX, FIVE, PLAIN]})


def _sections(prompt: str, first: str, second: str, end: str) -> tuple[str, str]:
    a = prompt.split(first, 1)[1].split(second, 1)[0]
    b = prompt.split(second, 1)[1].split(end, 1)[0]
    return a, b


def run_judge() -> ScriptedBackend:
    """The run's judge: a tool call matches when the candidate's says SAME; a message matches
    unless the candidate's says 5."""
    def reply(req):
        prompt = req.messages[-1]["content"]
        if "## Call A" in prompt:
            a, _ = _sections(prompt, "## Call A", "## Call B", "## Argument paths")
            return message_choice("VERDICT: MATCH" if "SAME" in a else "VERDICT: NO_MATCH")
        a, _ = _sections(prompt, "## Message A", "## Message B", "Do messages")
        return message_choice("VERDICT: NO_MATCH" if "5." in a else "VERDICT: MATCH")

    return ScriptedBackend("judge", reply)


def audit_judge() -> ScriptedBackend:
    """The audit judge: the planted disagreements of the module docstring, else as the rules
    and the run's judge would answer."""
    def reply(req):
        prompt = req.messages[-1]["content"]
        if "## Call A" in prompt:
            a, b = _sections(prompt, "## Call A", "## Call B", "## Argument paths")
            if "SAME" in a:
                return message_choice("Different text.\nVERDICT: NO_MATCH")
            if a.startswith(": add") and b.startswith(": add"):
                return message_choice("VERDICT: NO_MATCH")                 # wrong on equal calls
            if a.startswith(": note") and '"remember five"' in a and b.startswith(": add"):
                return message_choice("VERDICT: MATCH")                    # wrong on different tools
            same = a.split("\n", 1)[0] == b.split("\n", 1)[0] and a.strip() == b.strip()
            return message_choice("VERDICT: MATCH" if same else "VERDICT: NO_MATCH")
        return message_choice("VERDICT: MATCH")                            # every message the same act

    return ScriptedBackend("audit", reply)


@pytest.fixture(scope="module")
def env(tiny_tokenizer, tmp_path_factory):
    """The collected run directory and the running server (teacher, run's judge, audit judge)."""
    run_dir = tmp_path_factory.mktemp("run")
    judge, second = run_judge(), audit_judge()
    with serve(teacher_backend(SCRIPT), judge, second) as server:
        eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
        collector = make_collector(collector_config(), tiny_tokenizer, make_teacher(server), make_matcher(server),
                                   fixed_text_sample_fn(tiny_tokenizer, SCRIPT, eos))
        collector.judged_log = JudgedLog(run_dir, 0)
        result = collect_once(collector, [toy_task("plant", "plant")], step=3, process_index=0, process_count=1)
        (run_dir / "report.md").write_text("# Main job report: test\n\nbody\n")
        yield run_dir, server, second, result


def audit_args(run_dir, server, *extra) -> list[str]:
    return ["audit-matcher", "--run-dir", str(run_dir), "--judge-base-url", server.base_url, "--judge-model", "audit",
            "--judge-api-key-env", "none", *extra]


def test_a_collection_step_writes_every_judged_pair(env):
    run_dir, _, _, result = env
    assert [g.decision_index for g in result.groups] == [0, 1]
    states, read = read_judged(run_dir)
    assert read.files == 1 and read.lines == 2 and read.skipped_lines == 0 and len(states) == 2
    d0, d1 = states
    assert not d0.resolved  # counting pairs reads no context
    resolve_context(run_dir, states, read)
    assert read.missing_context == 0 and d0.resolved and d1.resolved
    assert (d0.step, d0.task_id, d0.decision, d1.decision) == (3, "plant", 0, 1)
    assert d0.candidates == [A, SAME_NOTE, NEAR_NOTE, B] and d0.teacher == [A, A, B]
    assert d0.stages == [["rules_match", "rules_match", "name_mismatch"],
                         ["name_mismatch", "name_mismatch", "judge"],
                         ["name_mismatch", "name_mismatch", "judge"],
                         ["name_mismatch", "name_mismatch", "rules_match"]]
    assert d0.verdicts == [["match", "match", "no_match"], ["no_match", "no_match", "match"],
                           ["no_match", "no_match", "no_match"], ["no_match", "no_match", "match"]]
    assert d1.stages == [["rules_match"] * 3] + [["judge"] * 3] * 3
    assert d1.verdicts == [["match"] * 3, ["match"] * 3, ["no_match"] * 3, ["match"] * 3]
    # the context the judge saw, resolved from the blobs: decision 1 adds the call and its result
    assert len(d0.messages) == 2
    assert d1.messages[:2] == d0.messages and d1.messages[3]["content"] == "5"
    assert [t["function"]["name"] for t in d1.tools] == ["add", "note"]
    # each message and the tool list stored once: system, user, the call, its result, tools
    blobs = (run_dir / "judged-blobs-p0.jsonl").read_text().splitlines()
    assert len(blobs) == 5


def test_the_audit_finds_exactly_the_planted_disagreements(env):
    run_dir, server, second, _ = env
    before = len(second.requests)
    assert actionopd(audit_args(run_dir, server, "--sample", "100")) == 0
    doc = json.loads((run_dir / "audit.json").read_text())
    s = doc["summary"]
    found = sorted((d["decision"], d["candidate_index"], d["teacher_index"], d["stratum"], d["run_verdict"],
                    d["audit_verdict"]) for d in s["disagreements"])
    assert found == [(0, 0, 0, "rules/match/tool_call", "match", "no_match"),
                     (0, 0, 1, "rules/match/tool_call", "match", "no_match"),
                     (0, 1, 2, "judge/match/tool_call", "match", "no_match"),
                     (0, 3, 0, "rules/no_match/tool_call", "no_match", "match"),
                     (0, 3, 1, "rules/no_match/tool_call", "no_match", "match"),
                     (1, 2, 0, "judge/no_match/message", "no_match", "match"),
                     (1, 2, 1, "judge/no_match/message", "no_match", "match"),
                     (1, 2, 2, "judge/no_match/message", "no_match", "match")]
    assert {k: (v["population"], v["answered"], v["disagreements"]) for k, v in s["strata"].items()} == {
        "judge/match/message": (6, 6, 0), "judge/match/tool_call": (1, 1, 1), "judge/no_match/message": (3, 3, 3),
        "judge/no_match/tool_call": (1, 1, 0), "rules/match/message": (3, 3, 0), "rules/match/tool_call": (3, 3, 2),
        "rules/no_match/tool_call": (7, 7, 2)}
    jj = s["judge_vs_judge"]
    assert jj["sample_table"] == [[6, 1], [3, 1]]
    assert jj["sample_agreement"] == pytest.approx(7 / 11) and jj["agreement"] == pytest.approx(7 / 11)
    assert jj["sample_kappa"] == pytest.approx(0.12) and jj["kappa"] == pytest.approx(0.12)
    assert jj["run_match_audit_no_match"] == pytest.approx(1 / 7)
    assert jj["run_no_match_audit_match"] == pytest.approx(3 / 4)
    assert s["rules"]["judge_no_match_where_rules_match"] == pytest.approx(2 / 6)
    assert s["rules"]["judge_match_where_rules_no_match"] == pytest.approx(2 / 7)
    # flips: judge strata only, (1*1 + 3*1) of 24 pair verdicts; candidates 1 and 6 of 8 (d = 1)
    assert s["definite_pairs"] == 24 and s["flips"]["pair_verdicts"] == pytest.approx(4 / 24)
    assert s["flips"]["candidate_rewards"] == pytest.approx(2 / 8) and s["flips"]["candidates"] == 8
    # 12 distinct questions (repeated teacher samples share one), each asked once
    assert doc["audit_judge"]["requests"] == {"questions": 12, "cached": 0, "asked": 12, "unavailable": 0}
    assert len(second.requests) - before == 12
    patterns = {p["pattern"]: p["count"] for p in s["patterns"]}
    assert patterns == {"judge/no_match/message: no_match -> match; message": 3,
                        "rules/match/tool_call: match -> no_match; add at (equal arguments)": 2,
                        "rules/no_match/tool_call: no_match -> match; tools note vs add": 2,
                        "judge/match/tool_call: match -> no_match; note at $.text": 1}
    # examples are distinct questions: each pattern here is one question (repeated teacher samples)
    assert [len(p["examples"]) for p in s["patterns"]] == [1, 1, 1, 1]


def test_the_report_renders_and_a_rerun_asks_nothing(env):
    run_dir, server, second, _ = env
    if not (run_dir / "audit.json").exists():
        assert actionopd(audit_args(run_dir, server, "--sample", "100")) == 0
    before = len(second.requests)
    # the registered command in its own process: the answers come from the run's audit cache
    proc = subprocess.run([sys.executable, "-m", "actionopd_jax.commands.main", *audit_args(run_dir, server,
                                                                                           "--sample", "100")],
                          capture_output=True, text=True, timeout=100, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    assert len(second.requests) == before
    doc = json.loads((run_dir / "audit.json").read_text())
    assert doc["audit_judge"]["requests"] == {"questions": 12, "cached": 12, "asked": 0, "unavailable": 0}
    md = (run_dir / "audit.md").read_text()
    assert "| judge/no_match/message | 3 | 3 | 3 | 3 | 100.0% |" in md
    assert "| rules/no_match/tool_call | 7 | 7 | 7 | 2 | 28.6% |" in md
    assert "| match | 6 | 1 |" in md and "Cohen's kappa 0.120" in md
    assert "- pair verdicts: 16.7% of all 24 definite pair verdicts" in md
    assert "**judge/no_match/message: no_match -> match; message** (3)" in md
    assert 'candidate message "The answer is 5." / teacher message "The answer is 6."' in md
    report = (run_dir / "report.md").read_text()
    assert report.startswith("# Main job report: test\n\nbody\n") and report.count("## Matcher audit") == 1
    assert "[audit.md](audit.md)" in report


def test_bad_input_gets_one_clear_error_and_writes_nothing(env, tmp_path, capsys, monkeypatch):
    run_dir, server, _, _ = env
    assert actionopd(audit_args(tmp_path / "nowhere", server)) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert actionopd(audit_args(tmp_path, server)) == 2
    err = capsys.readouterr().err
    assert "holds no judged pairs" in err and "Traceback" not in err
    monkeypatch.delenv("AUDIT_KEY_FOR_TEST", raising=False)
    args = audit_args(run_dir, server)
    args[args.index("none")] = "AUDIT_KEY_FOR_TEST"
    mtime = (run_dir / "report.md").stat().st_mtime_ns
    assert actionopd(args) == 2
    err = capsys.readouterr().err
    assert "'AUDIT_KEY_FOR_TEST' is not set" in err and "Traceback" not in err
    assert (run_dir / "report.md").stat().st_mtime_ns == mtime


def test_cohen_kappa_on_a_hand_computed_table():
    # n = 50, p_o = 35/50 = 0.7; rows 25/25, columns 30/20: p_e = (25*30 + 25*20)/2500 = 0.5
    assert cohen_kappa([[20, 5], [10, 15]]) == pytest.approx(0.4)
    assert cohen_kappa([[10, 0], [0, 10]]) == pytest.approx(1.0)
    assert cohen_kappa([[5, 0], [0, 0]]) is None  # both raters constant: kappa undefined


def test_stratified_sampling_is_seeded_and_spreads_the_sample():
    # 12 pairs: 1 to the 1-pair stratum, 11 // 2 = 5 to the next, the remaining 6 to the last
    assert allocate({"a": 1, "b": 10, "c": 10}, 12) == {"a": 1, "b": 5, "c": 6}
    assert allocate({"a": 3, "b": 4}, 100) == {"a": 3, "b": 4}
    strata = {"x": list(range(100)), "y": list(range(100, 150))}
    one, two = stratified_sample(strata, 20, seed=7), stratified_sample(strata, 20, seed=7)
    assert one == two and len(one["x"]) == 10 and len(one["y"]) == 10
    assert set(one["x"]) <= set(strata["x"]) and set(one["y"]) <= set(strata["y"])
    # a stratum's draw does not depend on the others
    assert stratified_sample({"x": strata["x"], "z": [1]}, 11, seed=7)["x"] == one["x"]


def test_a_line_cut_by_a_crash_is_skipped_and_the_next_record_starts_clean(tmp_path):
    log = JudgedLog(tmp_path, 0)
    msgs = [{"role": "user", "content": "hi"}]
    log.record(step=0, task_start=0, task_id="t", env="toy", decision=0, messages=msgs, tools=[],
               candidates=[A], teacher=[A], verdicts=[["match"]], matcher=None)
    log.close()
    with open(tmp_path / "judged-p0.jsonl", "a") as f:
        f.write('{"v": 1, "step": 0, "task_st')  # the crash
    log = JudgedLog(tmp_path, 0)
    log.record(step=1, task_start=0, task_id="t", env="toy", decision=0, messages=msgs, tools=[],
               candidates=[B], teacher=[A], verdicts=[["no_match"]], matcher=None)
    log.close()
    states, read = read_judged(tmp_path)
    assert [(s.step, s.stages) for s in states] == [(0, [["rules_match"]]), (1, [["name_mismatch"]])]
    assert read.skipped_lines == 1 and read.lines == 3
    assert len((tmp_path / "judged-blobs-p0.jsonl").read_text().splitlines()) == 2  # the message, the tools
    resolve_context(tmp_path, states, read)
    assert read.missing_context == 0 and states[1].messages == msgs
    # a state whose context is gone is left unresolved and counted, not guessed
    (tmp_path / "judged-blobs-p0.jsonl").unlink()
    states, read = read_judged(tmp_path)
    resolve_context(tmp_path, states, read)
    assert read.missing_context == 2 and not any(s.resolved for s in states)
