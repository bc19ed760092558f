"""`eval --sampler engine`: the in-process student runs through the continuous-batching
engine and plays the same episode, token for token, as with the static sampler."""

import asyncio

from actionopd_jax.eval import cli as eval_cli
from actionopd_jax.eval.agents import BackendAgent
from actionopd_jax.eval.runner import run_eval
from actionopd_jax.eval.tasks import select_tasks


def test_eval_with_the_engine_plays_the_static_samplers_episode(tmp_path):
    from actionopd_jax.engine import Engine
    from actionopd_jax.envs.registry import make_environment
    from actionopd_jax.testing.tiny_checkpoint import make_tiny_hf_checkpoint
    from tests._orbax_run_fixtures import bfcl_tokenizer

    # the tiny tokenizer plus one token per tool-schema line of the first BFCL base task (as the
    # main job builds its own): its opening is ~300 tokens, not ~3,700, so both samplers compile
    # and play it in a fraction of the time; what is compared, token for token, is unchanged
    tok = bfcl_tokenizer(tmp_path)
    tok_dir = tmp_path / "tokenizer"
    model_dir = make_tiny_hf_checkpoint(tmp_path / "tiny", seed=3, vocab_size=len(tok), max_position_embeddings=1024)
    make_env = lambda task: make_environment(task.env)
    (task,) = select_tasks("bfcl:base", limit=1)
    common = ["--hf", str(model_dir), "--tokenizer", str(tok_dir), "--bench", "bfcl:base", "--max-new-tokens", "8",
              "--concurrency", "1", "--engine-max-len", "1024", "--no-progress", "--out", str(tmp_path / "unused")]
    records = {}
    for sampler in ("static", "engine"):
        args = eval_cli.build_parser().parse_args(common + ["--sampler", sampler])
        backend = eval_cli.model_backend(args)
        assert isinstance(backend.sampler, Engine) == (sampler == "engine")
        (rec,), errors = asyncio.run(run_eval(BackendAgent(backend, max_tokens=8), [task], make_env,
                                              tmp_path / f"{sampler}.jsonl", progress=False))
        assert errors == []
        records[sampler] = rec
    assert records["engine"]["actions"] >= 1
    drop = ("seconds",)     # wall time: the only field that may differ
    assert {k: v for k, v in records["engine"].items() if k not in drop} == \
        {k: v for k, v in records["static"].items() if k not in drop}


def test_an_eval_whose_prompts_never_fit_warns_and_exits_1(tmp_path, capsys):
    """Issue 34 ("silent zeros"): every episode ended with context_budget before its first
    action, so the 0.0 it scores measures the configuration: the command says so and exits 1
    (the report is still written). Below half of the episodes it stays quiet."""
    from actionopd_jax.sampling.loading import build_tiny_demo

    model_dir, tok_dir = build_tiny_demo(tmp_path / "tiny", seed=3)
    code = eval_cli.main(["--hf", str(model_dir), "--tokenizer", str(tok_dir), "--bench", "bfcl:base", "--limit", "2",
                          "--max-new-tokens", "8", "--engine-max-len", "64", "--no-progress", "--sampler", "engine",
                          "--out", str(tmp_path / "out")])
    out = capsys.readouterr()
    assert code == 1, out.out + out.err
    assert "WARNING: 2 of 2 episodes ended before the agent's first action" in out.err
    assert (tmp_path / "out" / "episodes.jsonl").is_file()
    played = {"actions": 3, "end_reason": "env_done"}
    early = {"actions": 0, "end_reason": "context_budget"}
    assert eval_cli.unplayed([played, early]) == "" and eval_cli.unplayed([]) == ""
    assert eval_cli.unplayed([played, early, early]).startswith("WARNING: 2 of 3")
