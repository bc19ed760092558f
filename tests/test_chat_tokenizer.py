"""Offline tokenizers: the real Qwen3 vocabulary rebuilt from tiktoken ranks, and the tiny BPE.

Reference for the Qwen3 build: tiktoken (an independent BPE implementation) over the same
`qwen.tiktoken` ranks, plus ids known from the published Qwen3 tokenizer.
"""

from __future__ import annotations

import json
import unicodedata
from importlib import resources

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from _chat_fixtures import qwen3_tokenizer, qwen3_tokenizer_dir, tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401
from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer
from actionopd_jax.chat import tokenizer_cli
from actionopd_jax.chat.tokenizer import (
    QWEN3_ADDED_TOKENS,
    QWEN_SPLIT_PATTERN,
    merges_from_ranks,
    qwen_tiktoken_path,
    read_tiktoken_ranks,
)


@pytest.fixture(scope="module")
def tiktoken_reference():
    ranks = read_tiktoken_ranks(qwen_tiktoken_path())
    return tiktoken.Encoding(
        name="qwen3-reference",
        pat_str=QWEN_SPLIT_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={text: i for i, text, _ in QWEN3_ADDED_TOKENS},
    )


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


# --- Qwen3 ---------------------------------------------------------------------------------


def test_known_qwen3_ids(qwen3_tokenizer):
    assert encode(qwen3_tokenizer, "Hello world") == [9707, 1879]
    assert encode(qwen3_tokenizer, "<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
    assert encode(qwen3_tokenizer, "<|im_start|>assistant\n") == [151644, 77091, 198]
    assert encode(qwen3_tokenizer, "<|im_start|>system\n") == [151644, 8948, 198]
    assert encode(qwen3_tokenizer, "\n\n") == [271]
    assert encode(qwen3_tokenizer, " ") == [220]
    # digits are split one per token by the pre-tokenizer: "2024" -> "2","0","2","4"
    assert encode(qwen3_tokenizer, "2024") == [17, 15, 17, 19]


def test_special_tokens_at_real_ids(qwen3_tokenizer):
    tok = qwen3_tokenizer
    assert len(tok) == 151_669
    for token_id, text, _ in QWEN3_ADDED_TOKENS:
        assert tok.convert_tokens_to_ids(text) == token_id
        assert encode(tok, text) == [token_id]
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 151645)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 151643)
    # <|...|> markers vanish under skip_special_tokens, the tags a parser needs do not
    ids = encode(tok, "<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>"


def test_merges_one_per_multibyte_token():
    ranks = read_tiktoken_ranks(qwen_tiktoken_path())
    assert len(ranks) == 151_643
    merges = merges_from_ranks(ranks)
    # every non-byte token is reachable: 151,643 - 256 single bytes
    assert len(merges) == 151_643 - 256
    # merge order follows rank: the merged tokens appear in increasing rank
    merged_ranks = [ranks[a + b] for a, b in merges]
    assert merged_ranks == sorted(merged_ranks)
    # hand-checkable: "\n\n" (rank 271) is the merge of two "\n" (rank 198)
    assert (b"\n", b"\n") in merges


def test_matches_tiktoken_on_real_text(qwen3_tokenizer, tiktoken_reference):
    docs = [
        resources.files("tau2").joinpath(p).read_text(encoding="utf-8")
        for p in ("data/tau2/domains/airline/policy.md", "data/tau2/domains/retail/policy.md")
    ]
    docs.append(resources.files("bfcl_eval").joinpath("data/multi_turn_func_doc/travel_booking.json").read_text())
    docs += ["def f(x):\n\treturn x**2  # 平方\n", "naïve café — 東京 🚀 ﷽ 1,234.56e-7", "   \n\n  \t x  y\r\n"]
    for doc in docs:
        doc = unicodedata.normalize("NFC", doc)
        assert encode(qwen3_tokenizer, doc) == tiktoken_reference.encode(doc, allowed_special="all")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_roundtrip_and_tiktoken_parity(qwen3_tokenizer, tiktoken_reference, text):
    """decode(encode(x)) == x for NFC text (the tokenizer NFC-normalises, like Qwen3's)."""
    text = unicodedata.normalize("NFC", text)
    ids = encode(qwen3_tokenizer, text)
    assert qwen3_tokenizer.decode(ids) == text
    assert ids == tiktoken_reference.encode(text, allowed_special="all")


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "x = [1, 2.5, -3e10]", "  indented\n\tcode();", "Grüße aus Köln", "数字 12345 和 emoji 😀👍🏽",
     '{"name": "get_weather", "arguments": {"city": "Paris"}}'],
)
def test_roundtrip_examples(qwen3_tokenizer, text):
    assert qwen3_tokenizer.decode(encode(qwen3_tokenizer, text)) == text


def test_directory_loads_with_auto_tokenizer(qwen3_tokenizer_dir):
    cfg = json.loads((qwen3_tokenizer_dir / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>"
    assert "<tool_call>" in cfg["chat_template"]
    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir), local_files_only=True)
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert tok.chat_template == cfg["chat_template"]


def test_rebuild_reuses_existing_directory(qwen3_tokenizer_dir):
    from actionopd_jax.chat import build_qwen3_tokenizer

    before = (qwen3_tokenizer_dir / "tokenizer.json").stat().st_mtime_ns
    assert build_qwen3_tokenizer(qwen3_tokenizer_dir) == qwen3_tokenizer_dir
    assert (qwen3_tokenizer_dir / "tokenizer.json").stat().st_mtime_ns == before


def test_load_tokenizer_error_names_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="actionopd tokenizer --qwen3"):
        load_tokenizer(tmp_path)


# --- tiny ----------------------------------------------------------------------------------


def test_tiny_tokenizer_layout(tiny_tokenizer):
    tok = tiny_tokenizer
    assert len(tok) == 2048
    first = 2048 - len(QWEN3_ADDED_TOKENS)
    for offset, (_, text, _) in enumerate(QWEN3_ADDED_TOKENS):
        assert tok.convert_tokens_to_ids(text) == first + offset
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert "<tool_call>" in tok.chat_template
    # tool-use text compresses well below one token per byte
    text = 'Book a flight from SFO to JFK on 2024-05-01 for user sara_doe_496. {"name": "book_reservation"}'
    assert len(encode(tok, text)) < 0.6 * len(text.encode())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=120))
def test_tiny_roundtrip(tiny_tokenizer, text):
    text = unicodedata.normalize("NFC", text)
    ids = encode(tiny_tokenizer, text)
    assert max(ids, default=0) < 2048
    assert tiny_tokenizer.decode(ids) == text


def test_tiny_build_is_deterministic_and_sized(tmp_path):
    corpus = ["get_weather city Paris unit celsius " * 50, '{"name": "x", "arguments": {}} ' * 50]
    a = build_tiny_tokenizer(tmp_path / "a", vocab_size=300, corpus=corpus)
    b = build_tiny_tokenizer(tmp_path / "b", vocab_size=300, corpus=corpus)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    tok = load_tokenizer(a)
    assert len(tok) <= 300
    assert tok.convert_tokens_to_ids("</think>") == len(tok) - 1
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_tokenizer(tmp_path / "c", vocab_size=100)


def test_tiny_builtin_corpus_is_deterministic(tmp_path, tiny_tokenizer_dir):
    again = build_tiny_tokenizer(tmp_path / "again")
    assert (again / "tokenizer.json").read_bytes() == (tiny_tokenizer_dir / "tokenizer.json").read_bytes()


def test_cli_builds_tiny(tmp_path, capsys):
    assert tokenizer_cli.main(["--tiny", str(tmp_path / "t"), "--vocab-size", "512"]) == 0
    assert "512 ids" in capsys.readouterr().out
    assert len(load_tokenizer(tmp_path / "t")) == 512
    assert tokenizer_cli.main(["--tiny", str(tmp_path / "u"), "--vocab-size", "5"]) == 1
    assert "vocab_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tokenizer_cli.main([])


def test_a_long_text_tokenizes_without_transformers_length_warning(tiny_tokenizer_dir, caplog):
    """Issue 34: after a big request body, serve's log showed transformers' "Token indices
    sequence length is longer than the specified maximum" warning; lengths are our budgets'
    to refuse, so the loaded tokenizer carries no maximum of its own."""
    import logging

    from transformers.utils import logging as hf_logging

    from actionopd_jax.chat import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            ids = tok("hi " * 140_000)["input_ids"]
    finally:
        hf_logging.disable_propagation()
    assert len(ids) > 131_072
    assert "Token indices sequence length" not in caplog.text
