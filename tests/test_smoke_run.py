"""`actionopd train --smoke` as a new user runs it (issue 26): the run it leaves is one that
eval, serve and export load; the user's train.steps wins over the smoke settings; a rerun
with nothing left to train says so; a run refused at start-up leaves no folder behind."""

import json

import openai

from actionopd_jax.commands import train as train_cli
from actionopd_jax.eval import cli as eval_cli
from actionopd_jax.train import export_cli


def test_smoke_run_is_evaluated_served_and_exported_and_a_rerun_trains_nothing(tmp_path, capsys):
    run = tmp_path / "smoke"
    assert train_cli.main(["--smoke", "--run-dir", str(run), "train.steps=2", "run.tensorboard=false"]) == 0
    assert "smoke OK: 2 step(s) trained, checkpoint 2 restored identically" in capsys.readouterr().out
    assert (run / "tokenizer" / "tokenizer.json").is_file()

    out = tmp_path / "eval"
    # a smoke model's context cannot hold a BFCL prompt: its 0.0 is said to measure that (issue
    # 34's "silent zeros"), exit 1, the results written all the same
    assert eval_cli.main(["--checkpoint", str(run), "--bench", "bfcl:base", "--limit", "1", "--max-new-tokens",
                          "4", "--no-progress", "--out", str(out)]) == 1
    assert "WARNING: 1 of 1 episodes ended before the agent's first action" in capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())["summary"][0]["episodes"] == 1

    # serve: the same loading path as `actionopd serve --checkpoint RUN`, answering the SDK
    from actionopd_jax.sampling import Sampler
    from actionopd_jax.sampling.cli import model_with_tokenizer
    from actionopd_jax.sampling.loading import end_token_ids
    from actionopd_jax.serve.model_backend import ModelBackend
    from actionopd_jax.serve.openai_http import OpenAIServer

    cfg, model, tokenizer = model_with_tokenizer(checkpoint=str(run))
    backend = ModelBackend(Sampler(model, cfg, eos_ids=end_token_ids(tokenizer)), tokenizer, model_name="smoke",
                           default_max_tokens=3)
    with OpenAIServer(backend) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="smoke", messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens <= 3 and r.usage.prompt_tokens > 3

    hf = tmp_path / "hf"
    assert export_cli.main(["--checkpoint", str(run), "--out", str(hf)]) == 0
    assert (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file()
    capsys.readouterr()

    # the same command again: the run is resumed with nothing left to train, and says so
    assert train_cli.main(["--smoke", "--run-dir", str(run), "train.steps=2", "run.tensorboard=false"]) == 0
    printed = capsys.readouterr().out
    assert "smoke OK: nothing left to train (the run was already at step 2 of train.steps=2)" in printed
    assert "step(s) trained" not in printed


def test_a_run_refused_at_start_up_leaves_no_run_folder(tmp_path, capsys):
    """The refusal comes after the trainer made checkpoints/, tokenizer/, train.log and the
    teacher's cache/: training tasks that evaluation scores."""
    tok = tmp_path / "tok"
    from actionopd_jax.chat import build_tiny_tokenizer

    build_tiny_tokenizer(tok)
    run = tmp_path / "refused"
    code = train_cli.main([
        "--run-dir", str(run), "experiment.enabled=false", "collect.kind=actionopd", f"model.tokenizer={tok}",
        "teacher.kind=openai", "teacher.provider=vllm", "teacher.base_url=http://127.0.0.1:9/v1", "teacher.model=m", "matcher.kind=rules",
        "env.name=bfcl", "env.task_ids=[multi_turn_base_0]", "env.heldout_task_ids=[multi_turn_base_0]"])
    assert code == 2 and "that evaluation scores" in capsys.readouterr().err
    assert not run.exists()
    # a refused rerun in an existing folder removes only what it made
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    assert train_cli.main([
        "--run-dir", str(run), "experiment.enabled=false", "collect.kind=actionopd", f"model.tokenizer={tok}",
        "teacher.kind=openai", "teacher.provider=vllm", "teacher.base_url=http://127.0.0.1:9/v1", "teacher.model=m", "matcher.kind=rules",
        "env.name=bfcl", "env.task_ids=[multi_turn_base_0]", "env.heldout_task_ids=[multi_turn_base_0]"]) == 2
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
