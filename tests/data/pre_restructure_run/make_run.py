"""Writes the pre-restructuring run that tests/test_old_checkpoint.py loads (issue 22).

Run with the code BEFORE the restructuring (commit 6adbb28), from that tree's root:
    git worktree add /tmp/old 6adbb28 && cd /tmp/old && PYTHONPATH=$PWD JAX_PLATFORMS=cpu python <this file> <out dir>
It trains a 2-layer model of 16 hidden units for one step through the real Trainer and
Checkpointer (synthetic source, one CPU device, compute dtype bfloat16 over float32
parameters), then records, with the same old code, what load_model gives back: per-parameter
sums and the logits of a forward on fixed tokens (reference.json). Not a test module.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

LOGITS_SHOWN = 32
TOKENS = [[3, 17, 5, 250, 99, 1, 42, 7], [11, 12, 13, 14, 15, 16, 17, 18]]


def reference(run_dir: Path) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from actionopd_jax.train.run_model import load_model

    qcfg, model, info = load_model(run_dir)
    flat = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    sums = {"/".join(map(str, path)): [float(np.asarray(x, np.float64).sum()),
                                       float(np.abs(np.asarray(x, np.float64)).sum()), list(np.shape(x)),
                                       str(np.asarray(x).dtype)]
            for path, x in jax.tree_util.tree_flatten_with_path(flat)[0]
            for path in [[getattr(k, "key", k) for k in path]]}
    tokens = jnp.asarray(TOKENS, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = model(tokens, positions)
    logits = np.asarray(model.logits(hidden), np.float32)
    # the first LOGITS_SHOWN entries of every position exactly, and every position's sums over the vocab
    return {"step": info["step"], "tokens": TOKENS, "param_sums": sums,
            "logits_head": logits[..., :LOGITS_SHOWN].tolist(),
            "logits_sums": np.asarray(logits, np.float64).sum(-1).tolist(),
            "compute_dtype": qcfg.dtype, "param_dtype": qcfg.param_dtype,
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()}


def main(out: Path) -> None:
    from flax import nnx

    from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer
    from actionopd_jax.config import Config
    from actionopd_jax.model import Qwen3, Qwen3Config
    from actionopd_jax.model.weights import save_hf
    from actionopd_jax.train.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok_dir = build_tiny_tokenizer(tmp / "tokenizer")
        vocab = len(load_tokenizer(tok_dir))
        qcfg = Qwen3Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
                           max_position_embeddings=512)
        save_hf(Qwen3(qcfg, rngs=nnx.Rngs(0)), qcfg, tmp / "start")
        cfg = Config().replace(**{
            "experiment.enabled": False, "model.hf_path": str(tmp / "start"), "model.tokenizer": str(tok_dir),
            "model.dtype": "bfloat16", "train.steps": 1, "train.lr": 1e-3,
            "collect.synthetic.groups_per_step": 2, "run.progress": False, "run.tensorboard": False})
        if out.exists():
            shutil.rmtree(out)
        trainer = Trainer(cfg, run_dir=out)
        try:
            assert trainer.run() == 0
        finally:
            trainer.close()
        (out / "config.yaml").write_text(cfg.to_yaml())
    ref = reference(out)
    (out.parent / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
