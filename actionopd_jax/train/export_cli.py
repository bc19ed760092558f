"""`actionopd export`: write a training checkpoint's parameters as an HF safetensors directory.

    actionopd export --checkpoint RUN_OR_CHECKPOINT_DIR [--step N] --out HF_DIR

`--checkpoint` may be a run directory (its checkpoints/ is used), the checkpoint directory
itself or one step folder; without --step the latest finished step is exported. Only the
parameters are read (not the optimizer state), onto this host's first device. The output
loads with `load_hf` and with transformers' Qwen3ForCausalLM; the run's recorded tokenizer
(<run>/tokenizer/) is copied next to it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def export(checkpoint: str | Path, out: str | Path, step: int | None = None, *, dtype: str | None = None,
           tokenizer: bool = True, allow_unverified: bool = False) -> int:
    """Export and return the step written. The parameters are restored onto this host's first
    device (whatever mesh wrote them), the same path eval and serve use; with `tokenizer` the
    run's recorded tokenizer files are copied next to the weights."""
    from actionopd_jax.model.weights import save_hf
    from actionopd_jax.checkpoint import copy_tokenizer, load_model

    qcfg, model, info = load_model(checkpoint, step=step, dtype=dtype, allow_unverified=allow_unverified)
    save_hf(model, qcfg, out)
    if tokenizer:
        copy_tokenizer(info["tokenizer"], out)
    return info["step"]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="actionopd export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="run directory or its checkpoints/ directory")
    p.add_argument("--step", type=int, default=None, help="step to export (default: latest readable)")
    p.add_argument("--out", required=True, help="output directory for config.json + model.safetensors")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="weights dtype (default: as trained)")
    p.add_argument("--allow-unverified", action="store_true",
                   help="export a step that has no checksum manifest (refused otherwise)")
    args = p.parse_args(argv)
    from actionopd_jax.checkpoint import CheckpointError

    try:
        step = export(args.checkpoint, args.out, args.step, dtype=args.dtype, allow_unverified=args.allow_unverified)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"actionopd export: {e}", file=sys.stderr)
        return 2
    print(f"exported step {step} of {args.checkpoint} to {args.out}")
    return 0
