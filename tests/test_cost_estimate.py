"""The cost estimate `train --check` prints (train/cost_estimate.py, issue 35 item 2), held to
numbers computed by hand for a small recipe, and the prices' validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import load_config
from actionopd_jax.train.cost_estimate import describe, estimate

# 2 steps x 3 tau2 task starts (each played with the user simulator); decisions 1 / 2 / 4; K=2,
# N=4; replies up to 100 (teacher), 10 (judge), 50 (user); prompts capped at 1,000, student
# replies of up to 40 tokens; a vLLM teacher (it takes n: a state's K samples are one request)
RECIPE = ["train.steps=2", "collect.task_starts_per_step=3", "collect.max_decisions=4", "collect.teacher_samples=2",
          "collect.num_candidates=4", "collect.max_prompt_tokens=1000", "collect.max_response_tokens=40",
          "collect.kind=actionopd", "env.name=tau2",
          "teacher.kind=openai", "teacher.model=t", "teacher.base_url=http://127.0.0.1:9/v1", "teacher.max_tokens=100",
          "teacher.price=[2.0,0.5,10.0]", "matcher.model=j", "matcher.base_url=http://127.0.0.1:9/v1",
          "matcher.max_tokens=10", "matcher.context_window=2010", "env.user_model=u",
          "env.user_base_url=http://127.0.0.1:9/v1", "env.user_max_tokens=50", "teacher.provider=vllm",
          "matcher.provider=vllm", "env.user_provider=vllm"]


def test_the_estimate_by_hand():
    cfg = load_config(None, RECIPE)
    teacher, judge, user = estimate(cfg, first_prompt=(300, 500, 800))
    # states: 6 starts x (1, 2, 4) decisions = 6 / 12 / 24; vLLM takes n: one request a state
    assert teacher.requests == (6, 12, 24)
    # prompts, one copy a request: shortest 300; mean 500 + (2 - 1) // 2 x 20 = 500; the cap 1,000
    assert teacher.input_tokens == (6 * 300, 12 * 500, 24 * 1000)
    # replies: K=2 a state, 10% / 50% / 100% of 100
    assert teacher.output_tokens == (int(6 * 2 * 100 * 0.1), 12 * 2 * 50, 24 * 2 * 100)
    assert teacher.spend == pytest.approx(((1800 * 2 + 120 * 10) / 1e6, (6000 * 2 + 1200 * 10) / 1e6,
                                           (24000 * 2 + 4800 * 10) / 1e6))
    # judge: N x K = 8 pairs a state, none / half / all judged; prompts 512 / 2000 // 4 / 2000
    assert judge.requests == (0, 48, 192) and judge.input_tokens == (0, 48 * 500, 192 * 2000)
    assert judge.output_tokens == (0, 48 * 5, 192 * 10) and judge.spend is None
    # user (every tau2 start has one): none / half / every state; prompts 512 / max(512, 500 // 2) / 1,000
    assert user.requests == (0, 6, 24) and user.input_tokens == (0, 6 * 512, 24 * 1000)
    assert user.output_tokens == (0, 6 * 25, 24 * 50)
    lines = describe(cfg, [teacher, judge, user], "measured (4 tasks: 300 / mean 500 / 800 tokens)")
    assert "spend $0.00 / $0.02 / $0.10" in lines[1] and "no price (set matcher.price)" in lines[2]
    assert "  prompt sizes MEASURED: first prompts (4 tasks: 300 / mean 500 / 800 tokens)" in lines
    assert "2 steps x 3 task starts; 1 / 2 / 4 decisions each" in lines[5]
    assert "  teacher: K=2 samples a decision in one request, one prompt copy (teacher.provider=vllm takes n)" in lines


def test_a_provider_without_n_gets_k_requests_with_k_prompt_copies():
    """Issue 46 item 6: K samples were always priced as K requests; DashScope / DeepSeek /
    OpenRouter take no `n`, so there they are (the same replies either way)."""
    cfg = load_config(None, [*RECIPE, "teacher.provider=dashscope"])
    teacher = estimate(cfg, first_prompt=(300, 500, 800))[0]
    assert teacher.requests == (12, 24, 48)
    assert teacher.input_tokens == (12 * 300, 24 * 500, 48 * 1000)
    assert teacher.output_tokens == (120, 1200, 4800)
    assert "K=2 samples a decision as 2 requests, 2 prompt copies (teacher.provider=dashscope takes no n)" in \
        teacher.notes[0]


def test_without_a_measurement_the_prompts_are_the_cap_said_so_and_local_teachers_cost_nothing():
    cfg = load_config(None, RECIPE)
    teacher = estimate(cfg, None)[0]
    assert teacher.input_tokens == (6 * 1000, 12 * 1000, 24 * 1000)
    lines = describe(cfg, [teacher], "not measured: collect.max_prompt_tokens")
    assert ("  prompt sizes ASSUMED, not measured: every prompt is priced at collect.max_prompt_tokens=1,000, "
            "the high case") in lines
    local = load_config(None, [x for x in RECIPE if not x.startswith(("teacher.", "matcher.", "env."))])
    assert estimate(local, None) == [] and describe(local, [], "") == []


# the paper's mixture over 1 step x 64 starts, 4 decisions: states 64 / 128 / 256
MIXTURE = ["train.steps=1", "collect.task_starts_per_step=64", "env.name=awm", "env.mixture=[awm:59, envscaler:5]"]


def test_the_user_simulator_is_charged_only_where_a_task_has_one(tmp_path):
    """Issue 46 item 6: all 64 starts of the paper's mixture were charged a user simulator where
    only the 5 EnvScaler starts can have one (12.8x too high). Without the pools on this host
    every EnvScaler start is assumed conversational, and the note says so; with them, the
    admitted scenarios' own modes count."""
    gone = tmp_path / "absent"
    cfg = load_config(None, [*RECIPE, *MIXTURE, f"env.awm_dir={gone}/awm", f"env.envscaler_dir={gone}/es",
                             f"env.manifest={gone}/m.json"])
    user = estimate(cfg, None)[-1]
    # 5/64 of 0 / 128 x 0.5 / 256 states (before: 0 / 64 / 256)
    assert user.role == "user simulator" and user.requests == (0, 5, 20)
    assert user.input_tokens == (0, 5 * 512, 20 * 1000) and user.output_tokens == (0, 5 * 25, 20 * 50)
    assert "5 of 64 task starts a step are EnvScaler, every one assumed conversational (the pools are not on " \
           "this host" in user.notes[0]
    lines = describe(cfg, [user], "not measured: collect.max_prompt_tokens")
    assert any(x.startswith("  prompt sizes ASSUMED, not measured (the pools are not on this host: env.manifest=")
               for x in lines), lines
    # on this host: 4 EnvScaler scenarios admitted, 2 of them conversational -> 5/64 x 1/2 of the states
    data = Path(__file__).parent / "data"
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"pools": {
        "awm": {"admitted": ["library_loans_1/0", "recipe_box_2/1"]},
        "envscaler": {"admitted": ["mini_clinic_1", "mini_clinic_2", "mini_clinic_3", "mini_locker_1"]}}}))
    cfg = load_config(None, [*RECIPE, *MIXTURE, "train.steps=2", f"env.awm_dir={data / 'awm_mini'}",
                             f"env.envscaler_dir={data / 'envscaler_mini'}", f"env.manifest={manifest}",
                             "env.envscaler_conversational=[mini_clinic_1, mini_clinic_3]"])
    user = estimate(cfg, None)[-1]
    assert user.requests == (0, int(256 * 5 / 128 * 0.5), 512 * 5 // 128) == (0, 5, 20)
    assert user.notes[0].endswith("5 of 64 task starts a step are EnvScaler, 2 of their 4 admitted scenarios "
                                  "conversational")
    # BFCL has no user simulator: none charged even with one configured
    bfcl = load_config(None, [*RECIPE, "env.name=bfcl"])
    assert estimate(bfcl, None)[-1].requests == (0, 0, 0)


def test_kd_and_opd_runs_are_priced_by_their_own_formulas():
    """Issue 46 item 6: KD got ActionOPD's formula (K samples a state, a judge). KD (paper B.4):
    kd.trials teacher episodes a task start, one request of one sample a decision, no judge;
    OPD: one echo-scoring request a state of each of N student trajectories, nothing out."""
    kd = load_config(None, [*RECIPE, "collect.kind=kd", "train.loss=kd", "kd.trials=4"])
    teacher, user = estimate(kd, first_prompt=(300, 500, 800))   # no judge
    # states: 6 starts x 4 episodes x (1, 2, 4) decisions = 24 / 48 / 96
    assert teacher.requests == (24, 48, 96) and teacher.input_tokens == (24 * 300, 48 * 500, 96 * 1000)
    assert teacher.output_tokens == (240, 48 * 50, 96 * 100)
    assert teacher.spend == pytest.approx(((7200 * 2 + 240 * 10) / 1e6, (24000 * 2 + 2400 * 10) / 1e6,
                                           (96000 * 2 + 9600 * 10) / 1e6))
    assert user.requests == (0, 24, 96)
    lines = describe(kd, [teacher, user], "measured (1 tasks: 300 / mean 500 / 800 tokens)")
    assert "2 steps x 3 task starts x 4 KD episodes; 1 / 2 / 4 decisions each" in lines[4], lines
    recorded = load_config(None, [*RECIPE, "collect.kind=kd", "train.loss=kd", "kd.trajectories=/some/file.jsonl"])
    assert estimate(recorded, (300, 500, 800)) == []   # recorded episodes: nothing remote is asked
    opd = load_config(None, [*RECIPE, "collect.kind=opd", "train.loss=opd", "collect.temperature=1.0"])
    teacher, user = estimate(opd, first_prompt=(300, 500, 800))
    # states: 6 starts x N=4 trajectories x (1, 2, 4) = 24 / 48 / 96; input: prompt + 4 / 20 / 40 reply tokens
    assert teacher.requests == (24, 48, 96) and teacher.output_tokens == (0, 0, 0)
    assert teacher.input_tokens == (24 * 304, 48 * 520, 96 * 1040)


def test_prices_are_three_non_negative_numbers():
    with pytest.raises(ConfigError, match=r"teacher.price=\[1.0, 2.0\]: expected \[\] or three USD prices"):
        load_config(None, ["teacher.price=[1.0,2.0]"])
    with pytest.raises(ConfigError, match="matcher.price"):
        load_config(None, ["matcher.price=[1.0,-1.0,2.0]"])


def test_check_prints_the_estimate_for_the_paper_recipe(capsys):
    from actionopd_jax.commands import train as train_cli
    from tests._configs import CONFIGS

    assert train_cli.main(["--config", str(CONFIGS / "qwen3_4b_tpu.yaml"), "--check",
                           "teacher.price=[0.28,0.028,0.42]"]) == 0
    out = capsys.readouterr().out
    assert "cost of the remote models over the run (estimate: low / typical / high" in out
    teacher = next(x for x in out.splitlines() if x.startswith("  teacher "))
    # 100 steps x 64 starts x (1 / 20 / 40) decisions x K=3
    assert "requests 19,200 / 384,000 / 768,000" in teacher and "spend $" in teacher, teacher
    assert "prompt sizes ASSUMED, not measured (the pools are not on this host: " in out
    user = next(x for x in out.splitlines() if x.startswith("  user simulator "))
    # only the 5 EnvScaler starts of 64 (assumed conversational): 100 x 5 x (0 / 20 x 0.5 / 40) turns
    assert "requests 0 / 5,000 / 20,000" in user, user
