"""serve/token_floor.py: the fewest tokens a rendered prompt can have, read without tokenizing
it (issue 46). It must never exceed the real count, or serve would refuse a body that fits."""

import logging
import unicodedata

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from actionopd_jax.serve.token_floor import TokenFloor
from tests._serve_fixtures import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("floor"))


HANGUL = "".join(chr(0xAC00 + i * 37) for i in range(300))   # precomposed syllables (NFC)
TEXTS = {
    "prose": "What is the weather in Paris today? " * 200,
    "spaces": " " * 5000 + "x",   # the vocabulary's longest entries are runs of spaces
    "specials": "<|im_start|>user\nhi<|im_end|>\n" * 300,
    "json": '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2, 3]}}\n' * 100,
    "cjk_emoji": "天气怎么样？☀️🌧️ " * 300,
    "hangul_nfc": HANGUL,
    "hangul_nfd": unicodedata.normalize("NFD", HANGUL),   # 2-3 jamo, 6-9 bytes, per syllable
}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_the_floor_never_exceeds_the_token_count(tokenizer, name):
    floor = TokenFloor(tokenizer)
    text = TEXTS[name]
    tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert 0 <= floor(text) <= tokens, (floor(text), tokens)
    # byte-level (Qwen3's layout): the longest entry, 31 spaces written as 31 two-byte "Ġ", covers 31 bytes
    assert floor.max_token_bytes == 31


def test_the_floor_counts_text_as_the_tokenizer_normalizes_it(tokenizer):
    """Qwen3's tokenizer applies NFC first: 300 decomposed syllables are 2,667 bytes of input but
    900 bytes once composed, which is what the tokens cover."""
    floor = TokenFloor(tokenizer)
    nfd = TEXTS["hangul_nfd"]
    assert len(nfd.encode()) > 2.5 * len(HANGUL.encode())
    assert floor(nfd) == floor(HANGUL) == len(HANGUL.encode()) // floor.max_token_bytes
    assert floor.forms == ["NFC"]


class _Fast:
    """A fast tokenizer as transformers wraps one: its `tokenizers` object and its vocabulary."""

    def __init__(self, backend: Tokenizer):
        self.backend_tokenizer = backend

    def get_vocab(self):
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)


def _word_tokenizer(pre=None, normalizer=None) -> _Fast:
    backend = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    if pre is not None:
        backend.pre_tokenizer = pre
    if normalizer is not None:
        backend.normalizer = normalizer
    return _Fast(backend)


@pytest.mark.parametrize("case", ["drops_whitespace", "lowercases", "slow_tokenizer"])
def test_no_floor_where_the_tokenizer_may_drop_or_shrink_text(case, caplog):
    """A pre-tokenizer that drops whitespace (BERT-style), a normalizer other than a unicode
    normal form, or a tokenizer without a readable backend: the floor is 0 (every prompt is
    tokenized), and the log says why, once."""
    tok = {"drops_whitespace": _word_tokenizer(pre=pre_tokenizers.WhitespaceSplit()),
           "lowercases": _word_tokenizer(normalizer=normalizers.Lowercase()),
           "slow_tokenizer": object()}[case]
    floor = TokenFloor(tok)
    with caplog.at_level(logging.WARNING, logger="actionopd_jax.serve.token_floor"):
        assert floor(" " * 10_000 + "ab") == 0 and floor("ab " * 5000) == 0
    warnings = [r.getMessage() for r in caplog.records if "no token floor" in r.getMessage()]
    assert len(warnings) == 1 and "every prompt is tokenized" in warnings[0], warnings


def test_a_keeping_pre_tokenizer_and_unicode_forms_keep_the_floor():
    tok = _word_tokenizer(pre=pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.ByteLevel()]),
                          normalizer=normalizers.Sequence([normalizers.NFD(), normalizers.NFKC()]))
    floor = TokenFloor(tok)
    assert floor("ab" * 100) == 100 and floor.forms == ["NFD", "NFKC"] and floor.max_token_bytes == 2
