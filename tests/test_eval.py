"""Evaluation harness: pass^k estimator, the reference policy through the harness, an
OpenAI-compatible endpoint (our loopback server) evaluated by the same code, resume."""

import asyncio
import json
from math import comb

import pytest

from actionopd_jax.envs.registry import make_environment
from actionopd_jax.eval import cli as eval_cli
from actionopd_jax.eval.agents import EndpointAgent, ReferenceAgent
from actionopd_jax.eval.metrics import pass_hat_k, summarize
from actionopd_jax.eval.runner import load_finished, run_eval
from actionopd_jax.eval.tasks import select_tasks
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.reference_backend import ReferenceBackend
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice


def test_pass_hat_k_hand_computed():
    succ, n = [4, 2, 0, 3], [4, 4, 4, 4]
    assert pass_hat_k(succ, n, 1) == pytest.approx((1 + 0.5 + 0 + 0.75) / 4)
    # pass^2: C(2,2)/C(4,2) = 1/6 and C(3,2)/C(4,2) = 3/6
    assert pass_hat_k(succ, n, 2) == pytest.approx((1 + 1 / 6 + 0 + 0.5) / 4)
    assert pass_hat_k(succ, n, 4) == pytest.approx(0.25)
    assert pass_hat_k([1], [3], 1) == pytest.approx(comb(1, 1) / comb(3, 1))
    with pytest.raises(ValueError, match="at least 3 trials"):
        pass_hat_k([1], [2], 3)
    with pytest.raises(ValueError, match="not in"):
        pass_hat_k([5], [4], 1)


def test_summarize_tau2_rows_use_pass_k():
    recs = [{"env": "tau2_airline", "group": "test", "task_id": t, "trial": i,
             "score": {"reward": float(ok)}}
            for t, oks in (("a", [1, 1]), ("b", [1, 0])) for i, ok in enumerate(oks)]
    (row,) = summarize(recs, ks=(1, 2, 3))
    assert row["pass^1"] == pytest.approx(0.75) and row["pass^2"] == pytest.approx(0.5)
    assert "pass^3" not in row  # only 2 trials per task


def _make_env(task):
    return make_environment(task.env)


def test_reference_policy_scores_100_percent_on_every_bfcl_base_task(tmp_path):
    tasks = select_tasks("bfcl:base")
    assert len(tasks) == 200
    records, errors = asyncio.run(run_eval(ReferenceAgent(), tasks, _make_env, tmp_path / "ep.jsonl", progress=False))
    assert errors == []
    (row,) = summarize(records)
    assert row["episodes"] == 200 and row["accuracy"] == 1.0 and row["strict_accuracy"] == 1.0


def test_endpoint_agent_over_http_same_harness_and_a_wrong_agent_scores_zero(tmp_path):
    tasks = select_tasks("bfcl:base", limit=4)
    with OpenAIServer([ReferenceBackend(tasks), ScriptedBackend("quitter", lambda r: message_choice("I can't."))]) as srv:
        ref = EndpointAgent(srv.base_url, "reference-teacher-privileged")
        records, errors = asyncio.run(run_eval(ref, tasks, _make_env, tmp_path / "a.jsonl", progress=False))
        assert errors == [] and summarize(records)[0]["accuracy"] == 1.0
        bad = EndpointAgent(srv.base_url, "quitter")
        records, errors = asyncio.run(run_eval(bad, tasks, _make_env, tmp_path / "b.jsonl", progress=False))
        assert errors == [] and summarize(records)[0]["accuracy"] == 0.0
        # the quitter answers each scripted user turn with one message: one action per turn
        from actionopd_jax.envs.bfcl_data import load_entry

        assert all(r["actions"] == len(load_entry(r["task_id"])["question"]) for r in records)


def test_unavailable_endpoint_is_not_recorded_and_resume_runs_only_missing(tmp_path):
    tasks = select_tasks("bfcl:base", limit=3)
    out = tmp_path / "ep.jsonl"
    # A dead endpoint: no episode is written, each is reported as an error.
    from actionopd_jax.teacher.transport import RetryPolicy

    dead = EndpointAgent("http://127.0.0.1:9/v1", "nobody", timeout_s=2, retry=RetryPolicy(max_attempts=1))
    records, errors = asyncio.run(run_eval(dead, tasks, _make_env, out, progress=False))
    assert records == [] and len(errors) == 3 and not load_finished(out)

    asyncio.run(run_eval(ReferenceAgent(), tasks[:2], _make_env, out, progress=False))
    with out.open("a") as f:
        f.write('{"task_id": "torn')  # a kill mid-write leaves a torn last line
    before = load_finished(out)
    # episodes are written as they finish, in any order (they run concurrently)
    assert sorted(r["task_id"] for r in before) == sorted(t.task_id for t in tasks[:2])

    class Counting(ReferenceAgent):
        episodes: set = set()

        async def act(self, obs, *, task, trial):
            self.episodes.add(task.task_id)
            return await super().act(obs, task=task, trial=trial)

    agent = Counting()
    records, errors = asyncio.run(run_eval(agent, tasks, _make_env, out, progress=False))
    assert errors == [] and agent.episodes == {tasks[2].task_id}  # only the missing episode ran
    assert sorted(r["task_id"] for r in load_finished(out)) == sorted(t.task_id for t in tasks)
    assert len(records) == 3


def test_eval_cli_writes_json_markdown_and_png(tmp_path, capsys):
    out = tmp_path / "eval"
    rc = eval_cli.main(["--reference", "--bench", "bfcl:base,miss_param", "--limit", "2", "--out", str(out),
                        "--no-progress"])
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    groups = {(r["env"], r["group"]): r for r in result["summary"]}
    assert set(groups) == {("bfcl", "base"), ("bfcl", "miss_param")}
    assert groups[("bfcl", "base")]["accuracy"] == 1.0
    assert (out / "scores.png").read_bytes()[:4] == b"\x89PNG"
    assert "| bfcl | base | 2 |" in (out / "report.md").read_text()
    assert "| bfcl | base |" in capsys.readouterr().out


def test_eval_cli_on_a_tiny_hf_student(tmp_path):
    """A (random, tiny) student checkpoint through the in-process model backend: the harness
    runs it greedily, records every episode and scores it (a random model scores 0)."""
    from actionopd_jax.sampling.loading import build_tiny_demo

    model_dir, tok_dir = build_tiny_demo(tmp_path / "tiny", seed=3)
    common = ["--hf", str(model_dir), "--tokenizer", str(tok_dir), "--bench", "bfcl:base", "--limit", "1",
              "--max-new-tokens", "8", "--no-progress"]
    # the demo model's own context is shorter than a BFCL prompt: the episode ends, nothing is
    # fabricated, and the command says its 0.0 measures that (exit 1, issue 34)
    assert eval_cli.main(common + ["--out", str(tmp_path / "short")]) == 1
    (rec,) = load_finished(tmp_path / "short" / "episodes.jsonl")
    assert rec["actions"] == 0 and rec["end_reason"] == "context_budget" and rec["score"]["official"] == 0.0


    # a task whose prompt fits the demo model's context runs greedily to a score
    from actionopd_jax.chat import load_tokenizer, render_ids
    from actionopd_jax.eval.agents import BackendAgent

    tok = load_tokenizer(tok_dir)
    short = next(t for t in select_tasks("bfcl:base")
                 if len(render_ids(tok, *_opening(t))) < 3500)
    args = eval_cli.build_parser().parse_args(common + ["--out", str(tmp_path / "unused")])
    settings = eval_cli.resolve_settings(args)
    backend = eval_cli.model_backend(args, settings)
    # table 8: the student is evaluated with thinking on (its chat template's switch), as trained
    assert backend.enable_thinking is True and settings.model.max_tokens == 8
    agent = BackendAgent(backend, max_tokens=8)
    records, errors = asyncio.run(run_eval(agent, [short], _make_env, tmp_path / "fit.jsonl", progress=False))
    assert errors == [] and records[0]["actions"] >= 1 and records[0]["end_reason"] != "context_budget"
    assert records[0]["score"]["official"] == 0.0  # random weights


def _opening(task):
    obs = asyncio.run(_make_env(task).reset(task))
    return obs.messages, obs.tools


def test_check_measures_first_prompts_and_the_reply_against_the_models_context(tmp_path, capsys):
    """Issue 43 items 2 and 9: `eval --check` read no model and measured no prompt, so a context
    that could not hold a benchmark's prompts was found only by every episode ending before its
    first action. It now reads the model's context from its config (no weights), measures each
    benchmark's first prompts under its tokenizer, says where a reply will be fitted, and
    refuses a benchmark whose prompts fill the whole context."""
    import re

    from actionopd_jax.sampling.loading import build_tiny_demo

    model_dir, tok_dir = build_tiny_demo(tmp_path / "tiny", seed=3)
    base = ["--hf", str(model_dir), "--tokenizer", str(tok_dir), "--check", "--limit", "2", "--bench", "bfcl:base",
            "--bench", "tau2_airline",   # tau2 needs a user simulator, or --check fails for want of it
            "--user-sim-url", "http://127.0.0.1:9/v1", "--user-sim-model", "u", "--user-sim-provider", "vllm"]
    # the tiny demo holds 4,096 positions: BFCL's first base task and tau2's policy do not fit
    assert eval_cli.main(base) == 2
    err = capsys.readouterr().err
    assert "bfcl:base: the first prompt of 1 of 2 task(s) fills the whole context (the model's 4,096 tokens" in err
    assert "tau2_airline: the first prompt of 2 of 2 task(s) fills the whole context" in err
    # the same weights with Qwen3's 40,960 positions (RoPE: no learned positions)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40_960}))
    assert eval_cli.main(base) == 0
    out = capsys.readouterr().out
    assert f"context    the model's 40,960 tokens ({model_dir}/config.json); 4,096 new tokens" in out, out
    bfcl = re.search(r"bfcl:base +longest first prompt ([\d,]+) tokens \(bfcl multi_turn_base_0\): fits with 4,096", out)
    tau2 = re.search(r"tau2_airline +longest first prompt at least ([\d,]+) tokens .*: fits with 4,096", out)
    assert bfcl and tau2, out
    # narrowed so that the reply no longer fits beside the prompts: said, with the reply they get
    n = max(int(bfcl.group(1).replace(",", "")), int(tau2.group(1).replace(",", "")))
    assert eval_cli.main([*base, "--engine-max-len", str(n + 100)]) == 0
    out = capsys.readouterr().out
    assert "leaves 100 tokens: its replies get at most that many, not 4,096" in out, out
