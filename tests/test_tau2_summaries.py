"""`actionopd tau2 summaries` (issue 33, item 5): an LLM behind a real OpenAI-compatible server on
127.0.0.1 drafts Self-ActionOPD's privileged summaries (paper B.5) of tau2 training tasks into
one reviewable JSONL; re-runs pay for nothing twice; training refuses unreviewed drafts."""

import json
from collections import Counter

import pytest

from actionopd_jax.baselines.privileged import load_summaries
from actionopd_jax.baselines.summary_drafts import INSTRUCTIONS, existing_output, summary_problem
from actionopd_jax.baselines.summary_file import read_summary_file
from actionopd_jax.baselines.wiring import check_self_teacher
from actionopd_jax.commands import tau2 as tau2_cli
from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import load_config, replace_keys
from actionopd_jax.envs.tau2_tasks import tau2_task
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice, tool_call_choice
from tests._configs import CONFIGS
from tests._teacher_fixtures import serve

RECIPE = CONFIGS / "self_actionopd_tau2_qwen3_4b_h200.yaml"
SHIPPED = RECIPE.parent / "self_actionopd_tau2_summaries.jsonl"
TELECOM = ("telecom/[mms_issue]airplane_mode_on|bad_network_preference|bad_wifi_calling|break_apn_mms_setting|"
           "break_app_sms_permission|data_mode_off|data_usage_exceeded|unseat_sim_card|"
           "user_abroad_roaming_enabled_off[PERSONA:None]")
A3 = "The user is Sophia Silva (user id sophia_silva_7557) and wants a refund for a cancelled reservation."
R2 = "The user wants to return items from a delivered order and be refunded to the original payment method."


def _reason(task_id: str) -> str:
    domain, tid = task_id.split("/", 1)
    return tau2_task(domain, tid).user_scenario.instructions.reason_for_call.strip()


class Drafter:
    """The scripted drafting model: a good summary for airline/3, an empty reply and then a good
    one for retail/2, and for the telecom task JSON, a tool call and JSON again (garbled)."""

    def __init__(self):
        self.asked: Counter = Counter()
        self.replies = {"airline/3": [message_choice(A3)],
                        "retail/2": [message_choice(""), message_choice(R2)],
                        TELECOM: [message_choice('{"summary": "x"}'), tool_call_choice("get_status_bar", {}),
                                  message_choice("```json\n{}\n```")]}
        self.reasons = {t: _reason(t) for t in self.replies}

    def __call__(self, req):
        task = next(t for t, r in self.reasons.items() if r in req.messages[-1]["content"])
        self.asked[task] += 1
        replies = self.replies[task]
        return replies[min(self.asked[task], len(replies)) - 1]


def _args(url, out, *extra):
    tasks = ",".join(["airline/0", "airline/3", "retail/2", TELECOM])  # airline/0 is a shipped, reviewed example
    return ["summaries", "--base-url", url, "--model", "drafter-x", "--out", str(out), "--tasks", tasks,
            "--attempts", "3", "--temperature", "0.3", "--max-tokens", "512", "--examples", str(SHIPPED), *extra]


def test_summaries_drafted_over_http_checked_resumable_and_refused_until_reviewed(tmp_path, capsys):
    drafter = Drafter()
    backend = ScriptedBackend("drafter-x", drafter)
    out = tmp_path / "summaries.jsonl"
    with serve(backend) as server:
        code = tau2_cli.main(_args(server.base_url, out))
        first = capsys.readouterr().out
        # 1 + 2 + 3 requests: airline/0 copied, retail/2 retried after an empty reply, telecom garbled thrice
        assert code == 1 and server.request_count == 6
        assert drafter.asked == {"airline/3": 1, "retail/2": 2, TELECOM: 3}
        rows = {json.loads(line)["task_id"]: json.loads(line) for line in out.read_text().splitlines()}
        assert set(rows) == {"airline/0", "airline/3", "retail/2", TELECOM}
        assert rows["airline/0"] == {"task_id": "airline/0", "summary": load_summaries(SHIPPED)["airline/0"],
                                     "reviewed": True}
        for task, text in (("airline/3", A3), ("retail/2", R2)):
            r = rows[task]
            assert (r["summary"], r["reviewed"], r["model"]) == (text, False, "drafter-x") and r["drafted_at"]
        bad = rows[TELECOM]
        assert "summary" not in bad and bad["attempts"] == 3 and "JSON or code" in bad["error"]
        assert "tool call" in bad["error"]
        # the requests: the instructions, the domain's reviewed example, then the task's private
        # goals and evaluation criteria; table 8-style sampling fields from the flags
        req = next(r for r in backend.requests if drafter.reasons["airline/3"] in r.messages[-1]["content"])
        ins = tau2_task("airline", "3").user_scenario.instructions
        body = req.messages[-1]["content"]
        assert req.messages[0] == {"role": "system", "content": INSTRUCTIONS}
        assert req.messages[2] == {"role": "assistant", "content": load_summaries(SHIPPED)["airline/0"]}
        assert ins.known_info.strip() in body and ins.task_instructions.strip() in body
        for a in tau2_task("airline", "3").evaluation_criteria.nl_assertions or []:
            assert a in body
        assert (req.temperature, req.max_tokens) == (0.3, 512)
        t_body = next(r for r in backend.requests if drafter.reasons[TELECOM] in r.messages[-1]["content"])
        # hidden simulator state (which settings are broken) and the task id stay out
        assert "break_apn_mms_setting" not in json.dumps(t_body.messages) and "[PERSONA" not in json.dumps(t_body.messages)
        assert "drafted" in first and "requests 6" in first

        # a re-run pays for nothing: every task has a line (the error one waits for --retry-errors)
        before = out.read_text()
        assert tau2_cli.main(_args(server.base_url, out)) == 0
        assert server.request_count == 6 and out.read_text() == before
        drafter.replies[TELECOM] = [message_choice("The user is a customer abroad who cannot send MMS messages "
                                                   "and does not want to change the data plan.")]
        drafter.asked.clear()
        assert tau2_cli.main(_args(server.base_url, out, "--retry-errors")) == 0
        assert server.request_count == 7 and drafter.asked == {TELECOM: 1}

    # the loader: reviewed lines are used, drafts are not until a human flips the flag
    f = read_summary_file(out)
    assert set(f.reviewed) == {"airline/0"} and set(f.unreviewed) == {"airline/3", "retail/2", TELECOM}
    assert not f.failed  # the later summary supersedes the error line
    cfg = replace_keys(load_config(RECIPE), **{"teacher.privileged_summaries": str(out),
                                                 "env.task_ids": ["airline/0", "airline/3"]})
    with pytest.raises(ConfigError, match=r"1 training task\(s\) have only an unreviewed drafted summary.*"
                                          r"\['airline/3'\].*set \"reviewed\": true"):
        check_self_teacher(cfg)
    reviewed = [dict(json.loads(line), reviewed=True) for line in out.read_text().splitlines()
                if "summary" in json.loads(line)]
    out.write_text("".join(json.dumps(r) + "\n" for r in reviewed))
    check_self_teacher(cfg)  # no exception: every training task has a reviewed summary
    assert load_summaries(out)["airline/3"] == A3 and len(load_summaries(out)) == 4


def test_bad_input_is_refused_in_one_paragraph_and_nothing_is_lost(tmp_path, capsys, monkeypatch):
    out = tmp_path / "s.jsonl"
    good = json.dumps({"task_id": "airline/3", "summary": A3, "reviewed": False}) + "\n"
    out.write_text(good + "not json\n")
    with serve(ScriptedBackend("drafter-x", lambda req: message_choice(A3))) as server:
        assert tau2_cli.main(_args(server.base_url, out)) == 2
        err = capsys.readouterr().err
        assert "line 2 is not JSON" in err and "Nothing was changed" in err and out.read_text() == good + "not json\n"
        assert tau2_cli.main(["summaries", "--base-url", server.base_url, "--model", "m", "--out", str(out),
                              "--tasks", "airline/2"]) == 2  # airline/2 is a test-split task
        assert "['airline/2'] is not tau2 training task(s)" in capsys.readouterr().err
        monkeypatch.delenv("DRAFT_KEY_FOR_TEST", raising=False)
        out.write_text(good)
        assert tau2_cli.main(_args(server.base_url, out, "--api-key-env", "DRAFT_KEY_FOR_TEST")) == 2
        assert "'DRAFT_KEY_FOR_TEST' is not set" in capsys.readouterr().err
        assert server.request_count == 0 and out.read_text() == good


def test_a_line_cut_by_a_kill_is_dropped_and_the_rest_kept(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    good = json.dumps({"task_id": "airline/3", "summary": A3, "reviewed": False}) + "\n"
    out.write_text(good + '{"task_id": "retail/2", "summ')
    found = existing_output(out)
    assert set(found.unreviewed) == {"airline/3"} and out.read_text() == good
    assert "dropped an incomplete last line" in capsys.readouterr().out


@pytest.mark.parametrize("message, finish, problem", [
    ({"content": "   "}, "stop", "empty"),
    ({"content": "The user is Ann, user id ann_1, and wants a refund of her booking."}, "length", "cut at max_tokens"),
    ({"content": "<think>plan</think>The user is Ann, user id ann_1, and wants a refund of her booking."}, "stop", None),
    ({"content": "The user is Ann."}, "stop", "too short"),
    ({"content": "The user says: You want to cancel reservation EHGLP3 because you were out of town for weeks."},
     "stop", "copies an instruction line verbatim"),
])
def test_a_reply_is_kept_only_when_it_reads_as_a_summary(message, finish, problem):
    private = ["You want to cancel reservation EHGLP3 because you were out of town for weeks.\nYou are Ann."]
    text, got = summary_problem(message, finish, private)
    assert (got is None) if problem is None else (problem in got)
    if problem is None:
        assert text.startswith("The user is Ann") and "<think>" not in text
