"""What the `generate` and `serve` commands share: loading a model + tokenizer to sample from,
the end-of-turn token ids, and a tiny random demo model for smoke runs."""

from __future__ import annotations

import sys
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
               mesh=None, dtype: str | None = None, step: int | None = None,
               cfg_overrides: dict | None = None, record: dict | None = None,
               allow_unverified: bool = False) -> tuple[Qwen3Config, Any, Path | None]:
    """(config, model, tokenizer directory or None) from a Hugging Face directory (`hf`, or a
    `checkpoint` holding config.json) or a training run's Orbax checkpoint (`checkpoint` = run
    directory, its checkpoints/ folder or one step folder; `step` picks one, default the latest
    finished). The parameters land on `mesh` (None: the first local device) in `dtype` (None:
    as recorded). Bad paths raise ValueError / FileNotFoundError with what to do. `record`, when
    given, receives what was loaded: {"checkpoint", "step", "step_dir", "fallback_from",
    "verified"} for a run (scores then say which step they scored), {"hf"} for HF weights.
    `allow_unverified`: load a step that has no checksum manifest (refused otherwise)."""
    from actionopd_jax.model.weights import load_hf
    from actionopd_jax.checkpoint import CheckpointError
    from actionopd_jax.checkpoint import load_model as load_run_checkpoint

    if (hf is None) == (checkpoint is None):
        raise ValueError("give exactly one of --hf DIR or --checkpoint DIR")
    path = Path(hf if hf is not None else checkpoint)
    if hf is not None or (path / "config.json").is_file():
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a directory; pass a Hugging Face model directory "
                                    "(config.json + *.safetensors)")
        if not (path / "config.json").is_file():
            hint = " (it looks like a training run: use --checkpoint)" if (path / "checkpoints").is_dir() else ""
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory{hint}")
        if step is not None:
            raise ValueError(f"--step picks a step of a training run; {path} is an exported HF directory")
        overrides = dict(cfg_overrides or {})
        if dtype:
            overrides.update(param_dtype=dtype, dtype=dtype)
        cfg, model = load_hf(path, cfg_overrides=overrides or None, mesh=mesh)
        if record is not None:
            record.update(hf=str(path))
        return cfg, model, path
    try:
        cfg, model, info = load_run_checkpoint(path, step=step, mesh=mesh, dtype=dtype,
                                               allow_unverified=allow_unverified)
    except CheckpointError as e:
        raise ValueError(str(e)) from e
    fallback = f" (step {info['fallback_from']} was unreadable)" if info["fallback_from"] is not None else ""
    print(f"loaded step {info['step']} of {info['ckpt_dir']}{fallback}", file=sys.stderr)
    if record is not None:
        record.update(checkpoint=str(path), step=info["step"], step_dir=str(info["step_dir"]),
                      fallback_from=info["fallback_from"], verified=info["verified"])
    return cfg, model, info["tokenizer"]


def model_name_of(path: str | Path) -> str:
    """A served / evaluated model's default name: its directory, or the run's name for a
    checkpoints/ or step folder."""
    p = Path(path).resolve()
    while p.name.isdigit() or p.name == "checkpoints":
        p = p.parent
    return p.name


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
