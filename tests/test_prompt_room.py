"""`train --check` measures the training tasks' first prompts against collect.max_prompt_tokens
(envs/prompt_room.py) and refuses a budget that cannot hold them; a run whose step skips more
than half of its task starts for context overflow stops with that message (issue 33: two
shipped tau2 recipes had a 4,096-token budget against tau2 prompts of 4.8k-7.2k and trained
nothing while `--check` said "config OK")."""

from __future__ import annotations

import functools
import re

import pytest

from actionopd_jax.collect.collector import CollectResult
from actionopd_jax.collect.metrics import StepMetrics, TrajectoryRecord
from actionopd_jax.collect.source import check_prompt_room, overflow_stop, step_ends
from actionopd_jax.commands import train as train_cli
from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import from_dict
from actionopd_jax.envs.bfcl_data import task_ids
from tests._configs import CONFIGS

TAU2_H200 = str(CONFIGS / "tau2_qwen3_4b_h200.yaml")


@functools.cache
def _tokenizer():
    from actionopd_jax.collect.source import _check_tokenizer

    return _check_tokenizer(from_dict({}))[0]


def test_the_old_4096_token_tau2_recipe_is_refused_with_its_measured_prompts(capsys):
    """The H200 tau2 recipe as it shipped before (rows of 8,192, prompts of 4,096): refused,
    every task named as not fitting, the longest domains first with their lengths (the system
    prompt, greeting and tools every task of a domain shares: ~7.1k telecom, ~4.8k airline)."""
    code = train_cli.main(["--config", TAU2_H200, "--check", "train.max_seq_len=8192",
                           "collect.max_prompt_tokens=4096"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "collect.max_prompt_tokens=4,096 cannot hold the first prompt of 178 of 178 training tasks" in err
    assert "so the run trains nothing" in err and "paper B.5: 24,576" in err and "Traceback" not in err
    found = dict((d, int(n.replace(",", ""))) for d, n in re.findall(r"tau2_(\w+) \(before the user speaks\): "
                                                                     r"at least ([\d,]+)", err))
    assert list(found) == ["telecom", "airline", "retail"], err          # longest first
    assert 7000 < found["telecom"] < 7300 and 4700 < found["airline"] < 5000 and 4700 < found["retail"] < 5000


def test_the_shipped_tau2_recipe_has_room_for_its_longest_prompt(capsys):
    assert train_cli.main(["--config", TAU2_H200, "--check"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("prompts "))
    assert "the first prompts of 178 training tasks fit collect.max_prompt_tokens=24,576" in line, line
    assert "tau2_telecom" in line


def _bfcl_cfg(budget: int, ids: list[str]):
    return from_dict({"collect": {"kind": "actionopd", "max_prompt_tokens": budget},
                      "env": {"name": "bfcl", "domains": ["base"], "task_ids": ids, "allow_eval_overlap": True}})


def test_bfcl_first_prompts_are_rendered_per_task():
    """BFCL tasks differ (their own functions and question): each is rendered. A budget
    between the shortest and the longest refuses only those over it, by count."""
    ids = task_ids(["base"])[:4]
    line = check_prompt_room(_bfcl_cfg(100_000, ids), _tokenizer())
    n = [int(x.replace(",", "")) for x in re.findall(r"longest ([\d,]+) tokens", line)]
    assert "the first prompts of 4 training tasks fit" in line and len(n) == 1 and n[0] > 100, line
    with pytest.raises(ConfigError, match=r"cannot hold the first prompt of 4 of 4 training tasks .*bfcl "):
        check_prompt_room(_bfcl_cfg(50, ids), _tokenizer())


def _result(ends: list[tuple[str, int]]) -> CollectResult:
    records = [TrajectoryRecord(task_start=i, task_id=f"t{i}", env="bfcl", decisions=d, end_reason=r)
               for i, (r, d) in enumerate(ends)]
    return CollectResult(step=3, groups=[], group_starts=[], trajectories=records, metrics=StepMetrics())


def _stop(ends):
    return overflow_stop(3, step_ends(_result(ends)), 4096)


def test_a_step_that_skips_most_task_starts_for_overflow_stops_the_run():
    """More than half of the task starts ended before their first decision for context
    overflow: the message that stops the run. Half, or overflow later in a trajectory (its
    earlier decisions trained), does not stop it."""
    stop = _stop([("context_overflow", 0)] * 3 + [("env_done", 2)])
    assert stop.startswith("step 3: 3 of 4 task starts ended before their first decision") and "4,096" in stop
    assert _stop([("context_overflow", 0)] * 2 + [("env_done", 2)] * 2) is None
    assert _stop([("context_overflow", 5)] * 4) is None
    assert _stop([]) is None


# --- the main job (configs/tiny/*) and the compare presets (issue 43 item 6) ---------------------

def _room(out: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith("prompts ")]


def test_the_main_jobs_check_measures_its_own_tasks_under_its_tokenizer(capsys):
    """`tiny_cpu` passed --check with a 256-token budget: the main job's check measured nothing.
    Its 13 training tasks' first prompts, under the job's tiny tokenizer, are now held against
    experiment.max_prompt_tokens, and the held-out prompts plus their reply against the
    student's 4,096 positions; the shipped config passes, 256 does not, and neither does a
    held-out reply budget the student cannot hold."""
    tiny = str(CONFIGS / "tiny_cpu.yaml")
    assert train_cli.main(["--config", tiny, "--check"]) == 0
    out = capsys.readouterr().out
    train, held = _room(out)
    assert "the first prompts of 13 training tasks fit collect.max_prompt_tokens=3,072" in train, out
    assert "the job's tiny tokenizer" in train and "4,096-token context" in held
    longest = int(re.search(r"longest ([\d,]+) tokens", train).group(1).replace(",", ""))
    assert 256 < longest < 3072
    assert train_cli.main(["--config", tiny, "--check", "experiment.max_prompt_tokens=256"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"collect.max_prompt_tokens=256 cannot hold the first prompt of \d+ of 13 training tasks", err)
    assert "experiment.max_prompt_tokens" in err and "Traceback" not in err
    assert train_cli.main(["--config", tiny, "--check", "experiment.eval_max_new_tokens=4000"]) == 2
    assert "experiment.eval_max_new_tokens=4,000" in capsys.readouterr().err


def test_main_remote_teacher_is_measured_with_qwen3s_tokenizer(capsys):
    """`main_remote_teacher` passed with 1,024 tokens against prompts of ~2.4k (its checkpoint
    is not on this host: the offline Qwen3 tokenizer counts them, and says so)."""
    remote = str(CONFIGS / "main_remote_teacher.yaml")
    assert train_cli.main(["--config", remote, "--check"]) == 0
    train, _ = _room(capsys.readouterr().out)
    assert "fit collect.max_prompt_tokens=4,096" in train and "offline Qwen3 tokenizer" in train
    assert train_cli.main(["--config", remote, "--check", "collect.max_prompt_tokens=1024"]) == 2
    err = capsys.readouterr().err
    assert "collect.max_prompt_tokens=1,024 cannot hold the first prompt of 13 of 13 training tasks" in err
    assert "so the run trains nothing" in err


def test_compare_has_a_check_that_goes_through_the_prompt_room(capsys):
    """`actionopd compare` had no --check, and `train --check` on its preset said only "unknown
    config key 'compare'"."""
    from actionopd_jax.experiment import compare_cli

    preset = str(CONFIGS / "compare_tiny.yaml")
    assert compare_cli.main(["--config", preset, "--check"]) == 0
    out = capsys.readouterr().out
    assert len(_room(out)) == 2 and "config OK" in out
    assert "5 method(s) x 3 seed(s) = 15 run(s) of 8 update(s)" in out and "opd: not run here" in out
    assert compare_cli.main(["--config", preset, "--check", "experiment.max_prompt_tokens=256"]) == 2
    assert "cannot hold the first prompt" in capsys.readouterr().err
    assert train_cli.main(["--config", preset, "--check"]) == 2
    assert f"actionopd compare --config {preset} --check" in capsys.readouterr().err


def test_a_budget_plus_reply_over_the_models_context_is_refused(capsys):
    """Issue 43 item 2: a BFCL run whose prompt budget plus reply passes the student's own
    context (the tiny preset's positions) is refused by --check, saying what to lower."""
    from actionopd_jax.model import PRESETS

    ctx = PRESETS["tiny"].max_position_embeddings
    ids = task_ids(["base"])[1]  # its first prompt fits the budget below (multi_turn_base_0 does not)
    over = ["--check", "experiment.enabled=false", "collect.kind=actionopd", "env.name=bfcl", "env.domains=[base]", f"env.task_ids=[{ids}]",
            "env.allow_eval_overlap=true", "teacher.kind=openai", "teacher.model=t", "teacher.provider=vllm", "teacher.base_url=http://127.0.0.1:9/v1",
            f"collect.max_prompt_tokens={ctx - 100}", "collect.max_response_tokens=200",
            f"train.max_seq_len={ctx + 100}"]
    assert train_cli.main(over) == 2
    err = capsys.readouterr().err
    assert f"over the model's {ctx:,}-token context: lower collect.max_response_tokens to at most 100" in err, err
