"""The main job's student and tokenizer, built offline.

- Tokenizer: model.tokenizer, else the tokenizer next to model.hf_path, else a tiny byte-level
  BPE (`chat.build_tiny_tokenizer`) trained on the package corpus plus the job's tool schemas
  rendered with the chat template. The schemas are shared by every task of the job's classes
  (no task text, nothing held out), and they make up ~90% of every prompt: BPE merges learned
  on them cut the prompt from ~2.8k to ~2.5k tokens, and attention cost grows with its square.
  Cached under experiment.cache_dir (reused when its inputs are unchanged).
- Student: model.hf_path when set (a real checkpoint), else a random-init Qwen3 of
  experiment.student's shape written as an HF directory in the run directory, so that every
  phase (KD, ActionOPD, evaluation) starts from a directory, like a real student.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from actionopd_jax.types import Task

log = logging.getLogger(__name__)

SCHEMA_COPIES = 20  # weight of the tool-schema text against the 1.5M-character package corpus


def cache_root(exp: Any) -> Path:
    return Path(os.path.expanduser(exp.cache_dir or "~/.cache/actionopd_jax/main_job"))


def job_tool_schemas(tasks: list[Task]) -> list[dict]:
    """The OpenAI tool schemas of the tasks' classes (union, first occurrence order)."""
    from actionopd_jax.envs.bfcl_data import load_entry, to_openai_tool

    seen: dict[str, dict] = {}
    for t in tasks:
        for doc in load_entry(t.task_id)["function"]:
            seen.setdefault(doc["name"], to_openai_tool(doc))
    return list(seen.values())


def build_job_tokenizer(exp: Any, tasks: list[Task]) -> Path:
    """The tiny tokenizer of the job (see the module docstring); returns its directory."""
    from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer, render_text
    from actionopd_jax.chat.tiny_tokenizer import builtin_corpus

    root = cache_root(exp) / "tokenizers"
    base = load_tokenizer(build_tiny_tokenizer(root / f"tiny-{exp.tokenizer_vocab}", vocab_size=exp.tokenizer_vocab))
    schema_text = render_text(base, [{"role": "user", "content": ""}], job_tool_schemas(tasks))
    name = "-".join(sorted(exp.bfcl_classes))
    corpus = builtin_corpus() + [schema_text] * SCHEMA_COPIES
    return build_tiny_tokenizer(root / f"tiny-{exp.tokenizer_vocab}-{name}", vocab_size=exp.tokenizer_vocab,
                                corpus=corpus)


def tokenizer_dir(cfg: Any, tasks: list[Task]) -> Path:
    if cfg.model.tokenizer:
        return Path(cfg.model.tokenizer)
    if cfg.model.hf_path:
        return Path(cfg.model.hf_path)
    return build_job_tokenizer(cfg.experiment, tasks)


def random_student_config(exp: Any, vocab_size: int, *, dtype: str = "float32", param_dtype: str = "float32"):
    """Qwen3Config of the random-init student for a tokenizer of `vocab_size` ids."""
    from actionopd_jax.model import Qwen3Config

    s = exp.student
    vocab = -(-int(vocab_size) // 64) * 64
    return Qwen3Config(vocab_size=vocab, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                       num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                       num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim, rope_theta=1e6,
                       tie_word_embeddings=True, max_position_embeddings=s.max_position_embeddings,
                       dtype=dtype, param_dtype=param_dtype)


def initial_student(cfg: Any, tokenizer: Any, out_dir: Path) -> Path:
    """HF directory of the starting student (see the module docstring)."""
    if cfg.model.hf_path:
        path = Path(cfg.model.hf_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.hf_path={path} has no config.json: point it at a Hugging Face "
                                    "Qwen3 directory (config.json + safetensors)")
        return path
    import jax
    from flax import nnx

    from actionopd_jax.model import Qwen3
    from actionopd_jax.model.weights import save_hf

    qcfg = random_student_config(cfg.experiment, len(tokenizer), dtype=cfg.model.dtype,
                                 param_dtype=cfg.model.param_dtype)
    model = Qwen3(qcfg, rngs=nnx.Rngs(params=cfg.experiment.student.init_seed))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_hf(model, qcfg, out_dir)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    log.info("random-init student: %d parameters, hidden %d, %d layer(s), %d head(s) -> %s", n_params,
             qcfg.hidden_size, qcfg.num_hidden_layers, qcfg.num_attention_heads, out_dir)
    return out_dir
