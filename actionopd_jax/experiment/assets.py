"""The main job's student and tokenizer, built offline.

- Tokenizer: model.tokenizer, else the tokenizer next to model.hf_path, else a tiny byte-level
  BPE (`chat.build_tiny_tokenizer`) trained on the package corpus plus the job's tool schemas
  rendered with the chat template (shared by every task of the job's classes: no task text,
  nothing held out). Cached under experiment.cache_dir (reused when its inputs are unchanged).
  With experiment.schema_tokens, each tool's schema line -- exactly as the chat template
  renders it in every prompt -- is also one added token. The prompt still holds every schema
  verbatim (it decodes to the same text), but costs ~1 token per tool instead of ~120: a
  TradingBot prompt drops from ~2.6k to ~350-600 tokens. Why (observed while building the main job):
  with the schemas as text, a random-init student affordable on 2 CPU cores (dense attention
  over 2.6k tokens dominates the cost) learned one reply for every state -- the same
  first-token distribution at every state after 180 KD updates -- because the few tokens that
  say what to do next are diluted among ~2.5k identical schema tokens. The price: this
  student cannot read inside a schema; it learns the tools from the demonstrations. A real
  student (model.hf_path) uses its own tokenizer and reads the schemas as text.
- Student: model.hf_path when set (a real checkpoint), else a random-init Qwen3 of
  experiment.student's shape written as an HF directory in the run directory, so that every
  phase (warm start, ActionOPD, evaluation) starts from a directory, like a real student.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from actionopd_jax.config import Config
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


def schema_lines(tokenizer: Any, tools: list[dict]) -> list[str]:
    """The rendered tool block of the chat template, one JSON line per tool (exactly as it
    appears in every prompt of the job)."""
    from actionopd_jax.chat import render_text

    text = render_text(tokenizer, [{"role": "user", "content": ""}], tools)
    start, end = text.find("\n<tools>\n"), text.find("\n</tools>\n")
    lines = text[start + len("\n<tools>\n"):end].split("\n") if 0 <= start < end else []
    if len(lines) != len(tools) or not all(line.startswith("{") for line in lines):
        raise ValueError("the chat template's tool block is not one JSON line per tool inside <tools>...</tools>; "
                         "set experiment.schema_tokens=false")
    return lines


def add_schema_tokens(src: Path, dst: Path, lines: list[str]) -> Path:
    """Copy the tokenizer in `src` to `dst` with one added (non-special) token per tool line."""
    import hashlib
    import json
    import shutil

    from tokenizers import AddedToken, Tokenizer

    stamp = hashlib.sha256(json.dumps([str(src), lines]).encode()).hexdigest()[:16]
    marker = dst / "schema_tokens.sha"
    if marker.is_file() and marker.read_text() == stamp:
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    tok.add_tokens([AddedToken(line, normalized=False, special=False, single_word=False) for line in lines])
    tok.save(str(dst / "tokenizer.json"))
    marker.write_text(stamp)
    return dst


def build_job_tokenizer(exp: Any, tasks: list[Task]) -> Path:
    """The tiny tokenizer of the job (see the module docstring); returns its directory."""
    from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer, render_text
    from actionopd_jax.chat.tiny_tokenizer import builtin_corpus

    root = cache_root(exp) / "tokenizers"
    base = load_tokenizer(build_tiny_tokenizer(root / f"tiny-{exp.tokenizer_vocab}", vocab_size=exp.tokenizer_vocab))
    tools = job_tool_schemas(tasks)
    schema_text = render_text(base, [{"role": "user", "content": ""}], tools)
    name = "-".join(sorted(exp.bfcl_classes))
    corpus = builtin_corpus() + [schema_text] * SCHEMA_COPIES
    path = build_tiny_tokenizer(root / f"tiny-{exp.tokenizer_vocab}-{name}", vocab_size=exp.tokenizer_vocab,
                                corpus=corpus)
    if not exp.schema_tokens:
        return path
    return add_schema_tokens(path, root / f"tiny-{exp.tokenizer_vocab}-{name}-schema-tokens",
                             schema_lines(load_tokenizer(path), tools))


def tokenizer_dir(cfg: Config, tasks: list[Task]) -> Path:
    if cfg.model.tokenizer:
        return Path(cfg.model.tokenizer)
    if cfg.model.hf_path:
        return Path(cfg.model.hf_path)
    return build_job_tokenizer(cfg.experiment, tasks)


def random_student_config(exp: Any, vocab_size: int, *, param_dtype: str = "float32"):
    """Qwen3Config of the random-init student for a tokenizer of `vocab_size` ids."""
    from actionopd_jax.model import Qwen3Config

    s = exp.student
    vocab = -(-int(vocab_size) // 64) * 64
    return Qwen3Config(vocab_size=vocab, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                       num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                       num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim, rope_theta=1e6,
                       tie_word_embeddings=True, max_position_embeddings=s.max_position_embeddings,
                       param_dtype=param_dtype)


def initial_student(cfg: Config, tokenizer: Any, out_dir: Path) -> Path:
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

    qcfg = random_student_config(cfg.experiment, len(tokenizer), param_dtype=cfg.model.param_dtype)
    model = Qwen3(qcfg, rngs=nnx.Rngs(params=cfg.experiment.student.init_seed))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_hf(model, qcfg, out_dir)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    log.info("random-init student: %d parameters, hidden %d, %d layer(s), %d head(s) -> %s", n_params,
             qcfg.hidden_size, qcfg.num_hidden_layers, qcfg.num_attention_heads, out_dir)
    return out_dir
