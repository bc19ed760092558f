"""What the `generate` and `serve` commands share: loading a model + tokenizer to sample from,
the end-of-turn token ids, and a tiny random demo model for smoke runs."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from actionopd_jax.model import Qwen3Config

END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def end_token_ids(tokenizer: Any) -> list[int]:
    """Ids that end a reply: the Qwen end-of-turn / end-of-text tokens the tokenizer knows,
    plus its eos token."""
    ids = set()
    vocab = tokenizer.get_vocab()
    for text in END_TOKENS:
        if text in vocab:
            ids.add(int(vocab[text]))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("the tokenizer has neither <|im_end|> nor an eos token: cannot tell where a reply ends")
    return sorted(ids)


def load_model(*, hf: str | Path | None = None, checkpoint: str | Path | None = None,
               mesh=None, cfg_overrides: dict | None = None) -> tuple[Qwen3Config, Any, Path]:
    """(config, model, directory) from a Hugging Face directory (`hf`, or an exported
    `checkpoint` holding config.json) or a trainer checkpoint (read through
    `actionopd_jax.train.checkpoint.load_model`, when the trainer provides it)."""
    from actionopd_jax.model.weights import load_hf

    if (hf is None) == (checkpoint is None):
        raise ValueError("give exactly one of --hf DIR or --checkpoint DIR")
    path = Path(hf if hf is not None else checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    if (path / "config.json").is_file():
        cfg, model = load_hf(path, cfg_overrides=cfg_overrides, mesh=mesh)
        return cfg, model, path
    if hf is not None:
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        trainer_ckpt = importlib.import_module("actionopd_jax.train.checkpoint")
        restore = trainer_ckpt.load_model
    except (ImportError, AttributeError) as e:
        raise FileNotFoundError(
            f"{path} has no config.json; export the training checkpoint first with "
            f"`actionopd export --checkpoint {path} --out DIR` and serve DIR") from e
    cfg, model = restore(path, mesh=mesh)
    return cfg, model, path


def build_tiny_demo(out_dir: str | Path, *, seed: int) -> tuple[Path, Path]:
    """A tiny random Qwen3 checkpoint and a tiny tokenizer under `out_dir` (for smoke runs:
    the text it generates is noise). Returns (model dir, tokenizer dir)."""
    from flax import nnx

    from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer
    from actionopd_jax.model import PRESETS, Qwen3
    from actionopd_jax.model.weights import save_hf

    out_dir = Path(out_dir)
    tok_dir = build_tiny_tokenizer(out_dir / "tokenizer")
    cfg = PRESETS["tiny"].replace(vocab_size=max(PRESETS["tiny"].vocab_size, len(load_tokenizer(tok_dir))))
    model = Qwen3(cfg, rngs=nnx.Rngs(params=seed))
    save_hf(model, cfg, out_dir / "model")
    return out_dir / "model", tok_dir
