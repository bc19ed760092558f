"""A real training run to load back: a tiny model fitted to answer the weather question with a
tool call (tests/_serve_fixtures.py) is the starting point of a few trainer steps on an
8-device (2, 2, 2) CPU mesh, which write Orbax checkpoints and record the tokenizer."""

from __future__ import annotations

import functools
from pathlib import Path

from actionopd_jax.config import Config
from actionopd_jax.config.load import replace_keys
from actionopd_jax.model.weights import save_hf
from actionopd_jax.testing.tiny_checkpoint import tiny_config
from actionopd_jax.train.loop import Trainer
from actionopd_jax.train.sources import synthetic_source
from tests._serve_fixtures import trained_model

# room for the first BFCL base task's episode (RoPE has no learned positions, so the fitted
# model's short training context does not bound it)
CONTEXT = 4096


def bfcl_tokenizer(tmp: Path):
    """The tiny tokenizer with one token per tool-schema line of the first BFCL base task, as
    the main job builds its own (experiment/assets.py): the task's prompt is then short
    enough to play on CPU in seconds."""
    from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer
    from actionopd_jax.eval.tasks import select_tasks
    from actionopd_jax.experiment.assets import add_schema_tokens, job_tool_schemas, schema_lines

    base = build_tiny_tokenizer(tmp / "tokenizer-base")
    tools = job_tool_schemas(select_tasks("bfcl:base", limit=1))
    return load_tokenizer(add_schema_tokens(base, tmp / "tokenizer", schema_lines(load_tokenizer(base), tools)))
MESH_222 = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}


def build_run(tmp: Path, *, steps: int = 2) -> dict[str, Path]:
    """{"run": run dir, "tokenizer": tokenizer dir, "start": the HF weights it started from}."""
    tokenizer = bfcl_tokenizer(tmp)
    model = trained_model(tokenizer)
    start = tmp / "start"
    save_hf(model, tiny_config(vocab_size=len(tokenizer), max_position_embeddings=CONTEXT), start)
    cfg = replace_keys(Config(), **{
        **MESH_222, "experiment.enabled": False, "model.hf_path": str(start),
        "model.tokenizer": str(tmp / "tokenizer"), "train.steps": steps, "train.lr": 1e-5,
        "collect.synthetic.groups_per_step": 3, "run.progress": False, "run.tensorboard": False})
    run = tmp / "run"
    trainer = Trainer(cfg, run_dir=run, source=functools.partial(synthetic_source, cfg))
    try:
        assert trainer.run() == 0
        assert dict(trainer.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    finally:
        trainer.close()
    (run / "config.yaml").write_text(cfg.to_yaml())  # as `actionopd train` writes it
    return {"run": run, "tokenizer": tmp / "tokenizer", "start": start}
