"""`actionopd export`: write a training checkpoint's parameters as an HF safetensors directory.

    actionopd export --checkpoint RUN_OR_CHECKPOINT_DIR [--step N] --out HF_DIR

`--checkpoint` may be a run directory (its checkpoints/ is used) or the checkpoint
directory itself; without --step the latest readable step is exported. Only the parameters
are read (not the optimizer state). The output loads with `load_hf` and with transformers'
Qwen3ForCausalLM; copy the tokenizer files next to it to serve it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def export(checkpoint: str | Path, out: str | Path, step: int | None = None) -> int:
    """Export and return the step written."""
    from flax import nnx

    from actionopd_jax.model import Qwen3, Qwen3Config
    from actionopd_jax.model.weights import save_hf
    from actionopd_jax.train.checkpoint import Checkpointer, CheckpointError

    root = Path(checkpoint)
    ckpt_dir = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{checkpoint} is neither a run directory nor a checkpoint directory")
    ckpt = Checkpointer(ckpt_dir, read_only=True)
    try:
        restored = ckpt.restore(None, step, params_only=True)
    finally:
        ckpt.close()
    hf = restored.meta.get("model_config")
    if not hf:
        raise CheckpointError(f"checkpoint step {restored.step} has no model_config record")
    qcfg = Qwen3Config.from_hf_dict(hf, param_dtype=hf.get("dtype", "float32"))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Qwen3(qcfg, rngs=nnx.Rngs(0))), nnx.Param)
    model = nnx.merge(graphdef, restored.params)
    save_hf(model, qcfg, out)
    return restored.step


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="actionopd export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="run directory or its checkpoints/ directory")
    p.add_argument("--step", type=int, default=None, help="step to export (default: latest readable)")
    p.add_argument("--out", required=True, help="output directory for config.json + model.safetensors")
    args = p.parse_args(argv)
    from actionopd_jax.train.checkpoint import CheckpointError

    try:
        step = export(args.checkpoint, args.out, args.step)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"actionopd export: {e}", file=sys.stderr)
        return 2
    print(f"exported step {step} of {args.checkpoint} to {args.out}")
    return 0
