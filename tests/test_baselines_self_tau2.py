"""Self-ActionOPD's tau2 recipe (paper B.5, table 8) and its privileged input: a file of
prepared per-task summaries (baselines/privileged.py), never the simulator's raw instructions."""

import json
from collections import Counter
from pathlib import Path

import pytest

from actionopd_jax.baselines.privileged import load_summaries, privileged_context
from actionopd_jax.baselines.self_opd import TEACHER_EXTRA_TOKENS, self_teacher_settings
from actionopd_jax.commands import train as train_cli
from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import load_config, replace_keys
from actionopd_jax.envs.tau2_tasks import tau2_task
from actionopd_jax.experiment import compare_plan
from actionopd_jax.types import Task
from tests._configs import CONFIGS

RECIPE = "self_actionopd_tau2_qwen3_4b_h200.yaml"
TELECOM_0 = ("telecom/[mms_issue]airplane_mode_on|bad_network_preference|bad_wifi_calling|break_apn_mms_setting|"
             "break_app_both_permissions|data_mode_off|data_usage_exceeded|unseat_sim_card|"
             "user_abroad_roaming_disabled_off[PERSONA:Hard]")


def test_recipe_is_b5_eight_starts_per_domain_current_weights_4k_self_teacher():
    from actionopd_jax.collect.source import train_task_stream

    cfg = load_config(CONFIGS / RECIPE)
    assert cfg.teacher.kind == "self" and cfg.collect.kind == "actionopd" and cfg.train.loss == "actionopd"
    s = self_teacher_settings(cfg)  # table 8 "Self Teacher": thinking, T 0.6, p 0.95, k 20, 4k
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.enable_thinking) == (0.6, 0.95, 20, 4096, True)
    # B.5: student prompts up to 24,576 tokens, the teacher's (with its privileged summary) 28,672
    assert s.max_prompt_tokens == cfg.collect.max_prompt_tokens + TEACHER_EXTRA_TOKENS == 24576 + 4096 == 28672
    assert (cfg.collect.num_candidates, cfg.collect.teacher_samples) == (4, 3)
    starts = train_task_stream(cfg).next_step()
    assert Counter(t.env for t in starts) == {"tau2_airline": 8, "tau2_retail": 8, "tau2_telecom": 8}
    # the summaries file is named relative to the recipe and covers every training task
    path = Path(cfg.teacher.privileged_summaries)
    assert path == (CONFIGS / RECIPE).parent / "self_actionopd_tau2_summaries.jsonl" and path.is_file()
    assert set(load_summaries(path)) == set(cfg.env.task_ids) and len(cfg.env.task_ids) == 6


def test_privileged_context_is_the_summary_and_the_evaluation_criteria_not_the_raw_instructions():
    summaries = load_summaries((CONFIGS / RECIPE).parent / "self_actionopd_tau2_summaries.jsonl")
    retail = Task("retail/0", "tau2_retail", payload={"domain": "retail", "tau2_id": "0"})
    text = privileged_context(retail, summaries)
    raw = tau2_task("retail", "0").user_scenario.instructions
    assert summaries["retail/0"] in text and "exchange_delivered_order_items(" in text
    assert raw.task_instructions not in text and raw.reason_for_call not in text
    telecom = Task(TELECOM_0, "tau2_telecom", payload={"domain": "telecom", "tau2_id": TELECOM_0.split("/", 1)[1]})
    t_text = privileged_context(telecom, summaries)
    # a device operation is the instruction the agent gives in words, not user-tool syntax (B.5)
    assert "- ask the user to toggle airplane mode on their phone" in t_text
    assert "[user]" not in t_text and "toggle_airplane_mode" not in t_text


def test_privileged_context_holds_everything_b5_gives_the_teacher_about_the_targets():
    """Issue 43 item 7: B.5's privileged input is the reviewed summary, the reference tool names
    and arguments, the customer-side operations, the TARGET STATES and the REQUIRED MESSAGES from
    the evaluation criteria. The target states (tau2's env_assertions: every telecom task) and the
    outcome assertions (nl_assertions: every airline task) were left out. Each element of each
    shipped training task's criteria now appears, device-side ones in words."""
    summaries = load_summaries((CONFIGS / RECIPE).parent / "self_actionopd_tau2_summaries.jsonl")
    for task_id in summaries:
        domain, tau2_id = task_id.split("/", 1)
        text = privileged_context(Task(task_id, f"tau2_{domain}", payload={"domain": domain, "tau2_id": tau2_id}),
                                  summaries)
        criteria = tau2_task(domain, tau2_id).evaluation_criteria
        assert summaries[task_id] in text
        for a in criteria.actions or []:
            words = a.name.replace("_", " ")
            assert (f"ask the user to {words} on their phone" if a.requestor == "user" else f"- {a.name}(") in text
        for x in criteria.env_assertions or []:
            assert x.func_name.removeprefix("assert_").replace("_", " ") in text and "assert_" not in text
        for x in criteria.communicate_info or []:
            assert str(x) in text
        for x in criteria.nl_assertions or []:
            assert f"- {x}" in text, (task_id, x)
    telecom = Task(TELECOM_0, "tau2_telecom", payload={"domain": "telecom", "tau2_id": TELECOM_0.split("/", 1)[1]})
    t_text = privileged_context(telecom, summaries)
    assert "Target states (checked when the conversation ends):" in t_text
    assert "- the user's phone: can send mms (expected status: on) must hold" in t_text, t_text
    airline = Task("airline/0", "tau2_airline", payload={"domain": "airline", "tau2_id": "0"})
    assert "Required messages and outcomes:\n- Agent should refuse to proceed with the cancellation." in \
        privileged_context(airline, summaries)


def test_a_summary_line_counts_as_reviewed_only_when_it_says_so(tmp_path, capsys):
    """Issue 43 item 7: a summaries line with no "reviewed" key counted as reviewed; only
    `"reviewed": true` does now, and --check names such lines and what to do."""
    from actionopd_jax.baselines.summary_file import read_summary_file

    f = tmp_path / "s.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in (
        {"task_id": "airline/0", "summary": "checked", "reviewed": True},
        {"task_id": "airline/1", "summary": "nobody said", "model": "m"},
        {"task_id": "airline/3", "summary": "a draft", "reviewed": False})) + "\n")
    read = read_summary_file(f)
    assert read.reviewed == {"airline/0": "checked"} and read.unmarked == {"airline/1"}
    assert set(read.unreviewed) == {"airline/1", "airline/3"} and set(load_summaries(f)) == {"airline/0"}
    code = train_cli.main(["--config", str(CONFIGS / RECIPE), "--check", f"teacher.privileged_summaries={f}",
                           "env.task_ids=[airline/0,airline/1]"])
    err = capsys.readouterr().err
    assert code == 2 and "1 training task(s) have a summary line in" in err, err
    assert "that does not say \"reviewed\": true (first: ['airline/1'])" in err and "Traceback" not in err


@pytest.mark.parametrize("line, error", [
    ("not json", r"line 2 is not JSON"),
    (json.dumps({"task_id": "airline/1", "summary": "s", "notes": "x"}), r"line 2: unknown key\(s\) \['notes'\]"),
    (json.dumps({"task_id": "airline/1", "summary": "s", "reviewed": "yes"}), r"line 2: reviewed must be true or false"),
    (json.dumps({"task_id": "airline/1", "summary": "s", "error": "e"}), r"line 2: a line holds either a summary or an error"),
    (json.dumps({"task_id": "airline/1", "summary": "  "}), r"line 2: task_id and summary must be non-empty"),
    (json.dumps({"task_id": "airline/0", "summary": "again"}), r"line 2: task 'airline/0' has a second summary"),
])
def test_a_bad_summaries_file_names_the_line_and_the_fault(tmp_path, line, error):
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps({"task_id": "airline/0", "summary": "first", "reviewed": True}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=error):
        load_summaries(f)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_summaries(tmp_path / "missing.jsonl")


def test_missing_summaries_are_refused_by_the_config_and_by_check(capsys):
    cfg = load_config(CONFIGS / RECIPE)
    with pytest.raises(ConfigError, match="set teacher.privileged_summaries"):
        replace_keys(cfg, **{"teacher.privileged_summaries": ""})
    code = train_cli.main(["--config", str(CONFIGS / RECIPE), "--check", "env.task_ids=[airline/0,airline/3]"])
    err = capsys.readouterr().err
    assert code == 2 and "1 training task(s) have no prepared privileged summary (first: ['airline/3'])" in err


def test_compare_lists_self_actionopd_with_the_reason():
    reason = compare_plan.not_runnable(compare_plan.METHODS["self_actionopd"], privileged_teacher=True)
    assert "random-init student" in reason and RECIPE in reason
