"""`actionopd eval` runs as the paper evaluates (issue 33 item 2): table 8's evaluation rows and
B.3's trials and limits, from a recipe's eval: section or the paper defaults, each overridable
by a flag, recorded with the scores.

The expected values are written out here from table 8's *evaluation* rows (not the training
rows test_paper_endpoint_bodies.py pins) and B.3; they are not read from the recipes or the
defaults. The bodies are the ones a real OpenAI-compatible server on 127.0.0.1 receives from
the real `openai` client, through the `actionopd eval` command itself.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from actionopd_jax.commands.eval import load_eval_section
from actionopd_jax.commands.main import main
from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import load_config
from actionopd_jax.eval import cli as eval_cli
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.types import Observation, Task
from tests._configs import CONFIG_DIR
from tests.test_paper_endpoint_bodies import thinking_sent

TAU2 = CONFIG_DIR / "paper" / "tau2_qwen3_4b_tpu.yaml"

# Table 8, "Evaluation" rows. None: the table states no value, so the body must not carry it.
STUDENT_EVAL = dict(thinking=True, temperature=0.0, top_p=None, top_k=None, max_tokens=4 * 1024)  # greedy, 4k
USER_EVAL = dict(thinking=True, temperature=1.0, top_p=None, top_k=None, max_tokens=8 * 1024)  # Qwen3.5-9B, T=1, 8k
TEACHER_EVAL = {
    "qwen3.7-flash": dict(thinking=True, temperature=0.6, top_p=0.95, top_k=None, max_tokens=32 * 1024),
    "deepseek-v4-flash": dict(thinking=True, reasoning_effort="max", temperature=None, top_p=None, top_k=None,
                              max_tokens=32 * 1024),
    # table 8 has no evaluation row for the Tau teacher: ours, its training row (table 2's teacher)
    "qwen3-32b": dict(thinking=True, temperature=0.6, top_p=0.95, top_k=20, max_tokens=8 * 1024),
}
# B.3: tau2 four trials per task, BFCL one trial of at most 20 steps per turn
B3 = dict(trials=4, bfcl_trials=1, bfcl_max_steps_per_turn=20, nl_assertions="off")


def assert_row(body: dict, row: dict) -> None:
    for key, want in row.items():
        if key == "thinking":
            assert thinking_sent(body) is want, body
        elif want is None:
            assert key not in body, (key, body)
        else:
            assert body.get(key) == want, (key, body)


def test_check_lists_table8_evaluation_settings_and_the_tau_splits(capsys):
    assert main(["eval", "--config", str(TAU2), "--check"]) == 0
    out = capsys.readouterr().out
    assert "student  thinking on; greedy (T=0); 4,096 new tokens per reply" in out
    assert "tau user Qwen/Qwen3.5-9B at http://127.0.0.1:8002/v1; thinking on; T=1.0; 8,192 tokens" in out
    assert "trials   4 per tau2" in out and "BFCL 1, at most 20 steps per turn" in out
    assert "natural-language assertions off" in out
    # the Tau comparisons score both official splits (B.3: 30/20, 74/40, 74/40)
    for spec, n in (("tau2_airline:train", 30), ("tau2_airline:test", 20), ("tau2_retail:train", 74),
                    ("tau2_retail:test", 40), ("tau2_telecom:train", 74), ("tau2_telecom:test", 40)):
        assert f"{spec:<22} {n:>4} tasks x 4 trial(s) = {4 * n:,} episodes" in out


def test_every_command_takes_the_runs_share_of_gpu_memory(monkeypatch, capsys):
    """`actionopd eval` (and every other command) sets XLA's GPU memory share to the one `train`
    plans with before any device query, so the engine's pool and the static sampler's budget in
    eval and serve are sized from the same limit (jax's own default is 75%); a share the user set
    is kept. (On this CPU host the variable changes nothing: it is what the GPU reads.)"""
    import os

    from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert main(["eval", "--config", str(TAU2), "--check"]) == 0
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{USABLE_MEMORY_FRACTION:.2f}"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert main(["eval", "--config", str(TAU2), "--check"]) == 0
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    capsys.readouterr()


def test_transfer_recipes_score_all_base_tasks_and_800_bfcl_tasks_once(capsys):
    assert main(["eval", "--config", str(CONFIG_DIR / "paper" / "qwen3_4b_tpu.yaml"), "--check"]) == 0
    out = capsys.readouterr().out
    assert f"{'bfcl':<22}  800 tasks x 1 trial(s) = 800 episodes" in out
    for spec, n in (("tau2_airline:base", 50), ("tau2_retail:base", 114), ("tau2_telecom:base", 114)):
        assert f"{spec:<22} {n:>4} tasks x 4 trial(s)" in out


def _settings(argv: list[str]):
    args = eval_cli.build_parser().parse_args(argv)
    return args, eval_cli.resolve_settings(args, load_eval_section)


PAPER = sorted(p for p in (CONFIG_DIR / "paper").glob("*.yaml"))


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_every_recipe_evaluates_its_teacher_directly_with_table8s_row(path, monkeypatch):
    """`eval --config R --endpoint` gives the evaluated teacher table 8's evaluation row for
    the recipe's teacher (32k, not the training row's 4k / 8k), in its provider's spelling."""
    cfg = load_config(path)
    if cfg.teacher.kind != "openai":
        pytest.skip("Self-ActionOPD: its teacher is the student itself (nothing evaluated behind an API)")
    backend = ScriptedBackend("evaluated", lambda req: message_choice("Hello."))
    server = OpenAIServer([backend])
    server.start()
    try:
        args, settings = _settings(["--config", str(path), "--endpoint", server.base_url, "--model", "evaluated",
                                    "--out", "unused"])
        agent = eval_cli.make_agent(args, settings)
        task = Task(task_id="t", env="bfcl")
        asyncio.run(agent.act(Observation(messages=[{"role": "user", "content": "Hi"}], tools=[]), task=task, trial=0))
    finally:
        server.stop()
    assert settings.model.role == "teacher"
    assert_row(backend.requests[-1].raw, TEACHER_EVAL[cfg.teacher.model.split("/")[-1].lower()])
    assert {k: getattr(settings, k) for k in B3} == B3
    assert settings.user.model == "Qwen/Qwen3.5-9B"  # table 8's Tau evaluation user


def test_eval_command_sends_table8_student_and_user_rows_and_records_them(tmp_path, monkeypatch):
    """One tau2 episode through `actionopd eval --config`: a student served behind an endpoint
    (`--settings student`) and the tau user; both bodies carry their evaluation rows; the
    settings are written next to the scores, and a resume under other settings is refused."""
    monkeypatch.setenv("EVAL_USER_API_KEY", "user-key")
    said = []

    def user(req):
        said.append(req)
        return message_choice("I want to know my reservations." if len(said) == 1 else "###STOP###")

    student = ScriptedBackend("student", lambda req: message_choice("Could you give me your user id?"))
    user_backend = ScriptedBackend("user", user)
    server = OpenAIServer([student, user_backend])
    server.start()
    out = tmp_path / "eval"
    common = ["eval", "--config", str(TAU2), "--endpoint", server.base_url, "--model", "student", "--settings",
              "student", "--bench", "tau2_airline:test", "--limit", "1", "--trials", "1", "--user-sim-url",
              server.base_url, "--user-sim-model", "user", "--out", str(out), "--no-progress"]
    try:
        # the OpenAI API has no thinking switch: table 8's "thinking on" cannot reach it, refused
        assert main(common) == 2
        assert not student.requests
        assert main(common + ["--provider", "actionopd"]) == 0
        # the same directory under another temperature: refused, nothing added
        assert main(common + ["--provider", "actionopd", "--temperature", "0.7"]) == 2
    finally:
        server.stop()
    assert_row(student.requests[0].raw, STUDENT_EVAL)
    assert_row(user_backend.requests[0].raw, USER_EVAL)
    recorded = json.loads((out / "settings.json").read_text())
    assert recorded == json.loads((out / "results.json").read_text())["settings"]
    assert recorded["model"] == dict(role="student", temperature=0.0, top_p=None, top_k=None, enable_thinking=True,
                                     max_tokens=4096, provider="actionopd", reasoning_effort="")
    assert recorded["user"]["temperature"] == 1.0 and recorded["user"]["max_tokens"] == 8192
    assert recorded["nl_assertions"] == "off" and recorded["trials"] == 1
    assert "user-key" not in (out / "settings.json").read_text()  # the key's name only
    assert "natural-language assertions off" in (out / "report.md").read_text()
    assert len((out / "episodes.jsonl").read_text().splitlines()) == 1


def test_paper_defaults_without_a_recipe_and_flags_override_one_setting_each():
    _, s = _settings(["--checkpoint", "RUN", "--bench", "bfcl", "--out", "x"])
    assert (s.model.role, s.model.temperature, s.model.enable_thinking, s.model.max_tokens) == ("student", 0.0, True, 4096)
    assert (s.user.temperature, s.user.enable_thinking, s.user.max_tokens) == (1.0, True, 8192)
    assert (s.trials, s.bfcl_trials, s.bfcl_max_steps_per_turn) == (4, 1, 20)
    assert s.trials_for(Task(task_id="a", env="bfcl")) == 1
    assert s.trials_for(Task(task_id="b", env="tau2_retail")) == 4
    _, s = _settings(["--checkpoint", "RUN", "--bench", "bfcl", "--out", "x", "--thinking", "off",
                      "--max-new-tokens", "1024", "--user-sim-temperature", "0", "--bfcl-max-steps", "5"])
    assert (s.model.enable_thinking, s.model.max_tokens, s.user.temperature, s.bfcl_max_steps_per_turn) == \
        (False, 1024, 0.0, 5)
    assert s.model.temperature == 0.0 and s.user.max_tokens == 8192  # the others stay the paper's
    with pytest.raises(ValueError, match="no benchmark: pass --bench"):
        _settings(["--checkpoint", "RUN", "--out", "x"])


def test_the_eval_section_is_checked_and_retired_keys_say_where_they_went(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("eval:\n  benchmarks: [tau2_mars, 'tau2_retail:dev']\n  trials: 0\n  student:\n    top_p: 1.5\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    text = str(e.value)
    for part in ("unknown tau2 domain 'mars'", "unknown tau2 split 'dev'", "eval.trials must be >= 1",
                 "eval.student.top_p must be in (0, 1]"):
        assert part in text
    old = tmp_path / "old.yaml"  # a run's config.yaml from before the section was real
    old.write_text("eval:\n  every_steps: 0\n  max_tokens: 4096\n  trials: 1\n")
    assert load_config(old).eval.trials == 1
    old.write_text("eval:\n  max_tokens: 1024\n")
    with pytest.raises(ConfigError, match="eval.max_tokens=1024 is no longer a setting: .*eval.student.max_tokens"):
        load_config(old)
    user = tmp_path / "user.yaml"
    user.write_text("eval:\n  user:\n    model: u\n    provider: openai\n")
    with pytest.raises(ConfigError, match=r"eval.user.enable_thinking=True cannot be sent to provider 'openai'"):
        load_config(user)
