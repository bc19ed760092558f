"""The cost estimate `train --check` prints (train/cost_estimate.py, issue 35 item 2), held to
numbers computed by hand for a small recipe, and the prices' validation."""

from __future__ import annotations

import pytest

from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import load_config
from actionopd_jax.train.cost_estimate import describe, estimate

# 2 steps x 3 task starts; decisions 1 / 2 / 4; K=2, N=4; replies up to 100 (teacher), 10
# (judge), 50 (user); prompts capped at 1,000, student replies of up to 40 tokens
RECIPE = ["train.steps=2", "collect.task_starts_per_step=3", "collect.max_decisions=4", "collect.teacher_samples=2",
          "collect.num_candidates=4", "collect.max_prompt_tokens=1000", "collect.max_response_tokens=40",
          "teacher.kind=openai", "teacher.model=t", "teacher.base_url=http://127.0.0.1:9/v1", "teacher.max_tokens=100",
          "teacher.price=[2.0,0.5,10.0]", "matcher.model=j", "matcher.base_url=http://127.0.0.1:9/v1",
          "matcher.max_tokens=10", "matcher.context_window=2010", "env.user_model=u",
          "env.user_base_url=http://127.0.0.1:9/v1", "env.user_max_tokens=50", "teacher.provider=vllm",
          "matcher.provider=vllm", "env.user_provider=vllm"]


def test_the_estimate_by_hand():
    cfg = load_config(None, RECIPE)
    teacher, judge, user = estimate(cfg, first_prompt=(300, 500, 800))
    # states: 6 starts x (1, 2, 4) decisions = 6 / 12 / 24; teacher requests x K=2
    assert teacher.requests == (12, 24, 48)
    # prompts: shortest 300; mean 500 + (2 - 1) // 2 x 20 = 500; the cap 1,000
    assert teacher.input_tokens == (12 * 300, 24 * 500, 48 * 1000)
    assert teacher.output_tokens == (int(12 * 100 * 0.1), 24 * 50, 48 * 100)
    assert teacher.spend == pytest.approx(((3600 * 2 + 120 * 10) / 1e6, (12000 * 2 + 1200 * 10) / 1e6,
                                           (48000 * 2 + 4800 * 10) / 1e6))
    # judge: N x K = 8 pairs a state, none / half / all judged; prompts 512 / 2000 // 4 / 2000
    assert judge.requests == (0, 48, 192) and judge.input_tokens == (0, 48 * 500, 192 * 2000)
    assert judge.output_tokens == (0, 48 * 5, 192 * 10) and judge.spend is None
    # user: none / half / every state; prompts 512 / max(512, 500 // 2) / 1,000
    assert user.requests == (0, 6, 24) and user.input_tokens == (0, 6 * 512, 24 * 1000)
    assert user.output_tokens == (0, 6 * 25, 24 * 50)
    lines = describe(cfg, [teacher, judge, user], "measured")
    assert "spend $0.01 / $0.04 / $0.14" in lines[1] and "no price (set matcher.price)" in lines[2]
    assert "2 steps x 3 task starts; 1 / 2 / 4 decisions each" in lines[-1]


def test_without_a_measurement_the_prompts_are_the_cap_and_local_teachers_cost_nothing():
    cfg = load_config(None, RECIPE)
    teacher = estimate(cfg, None)[0]
    assert teacher.input_tokens == (12 * 1000, 24 * 1000, 48 * 1000)
    local = load_config(None, [x for x in RECIPE if not x.startswith(("teacher.", "matcher.", "env."))])
    assert estimate(local, None) == [] and describe(local, [], "") == []


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
    assert "first prompts not measured: collect.max_prompt_tokens" in out
