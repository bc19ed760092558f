"""The fewest tokens a rendered prompt can have, found without tokenizing it.

Serve refuses a body far over the context from this floor before it is tokenized: tokenizing
a 7.5 MB prompt took 30-40 s and over a gigabyte that the process never gave back (issue 34
for message content; issue 46 for the same bulk in tool-call arguments or tool schemas, which
the first floor, counting message content alone, let through).

The floor is taken over the prompt text the chat template rendered, so it counts every
text-bearing field the model would read (content, the reasoning the template shows, tool-call
names and arguments, tool names, descriptions and schemas) and nothing the template leaves out
(tool_call ids, message names, earlier turns' reasoning): whatever the template, a body that
fits is never refused. Rendering is cheap next to tokenizing (a 7.5 MB body: ~30 ms, ~20 MB).

It is a lower bound when (1) the text is first normalized as the tokenizer normalizes it
(Qwen3's NFC can shrink decomposed text to a third of its bytes), (2) the pre-tokenizer drops
no text, and (3) no token covers more bytes than `max_token_bytes`: under a byte-level
pre-tokenizer (Qwen3's) an entry's characters stand for one byte each, so its length in
characters; otherwise its UTF-8 length, which is never less than what it covers (a
sentencepiece "▁" is 3 bytes for a space; a byte-fallback "<0x41>" 6 for one byte); added
tokens are literal text. A BPE model that fuses runs of unknown characters into one token
would break it. Where any of these cannot be established from the tokenizer, the floor is 0
and every prompt is tokenized.
"""

from __future__ import annotations

import json
import logging
import threading
import unicodedata
from typing import Any

log = logging.getLogger(__name__)

_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
# pre-tokenizers that only split (or map bytes to characters), never dropping text
_KEEPING = ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation")


def _state(component: Any) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _forms(normalizer: dict | None) -> list[str] | None:
    """The unicode normal forms the normalizer applies, in order; None for any other normalizer
    (it could shrink text in ways this module does not reproduce)."""
    if normalizer is None:
        return []
    if normalizer.get("type") in _FORMS:
        return [normalizer["type"]]
    if normalizer.get("type") == "Sequence":
        parts = [_forms(n) for n in normalizer.get("normalizers", [])]
        return None if any(p is None for p in parts) else [f for p in parts for f in p]
    return None


def _has(pre: dict | None, kind: str) -> bool:
    if pre is None:
        return False
    return pre.get("type") == kind or any(_has(p, kind) for p in pre.get("pretokenizers", []))


def _keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") in _KEEPING and pre.get("behavior") != "Removed"


class TokenFloor:
    """`floor(text)`: tokens `text` has at least under `tokenizer` (0 where that cannot be
    bounded). Reads the tokenizer once, at first use; safe to call from several threads."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._ready = False
        self.max_token_bytes = 0   # 0: no floor for this tokenizer
        self.forms: list[str] = []
        self.why_off = ""

    def _read(self) -> None:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            self.why_off = "not a fast (tokenizers) tokenizer: its normalization cannot be read"
            return
        model = backend.model
        forms = _forms(_state(backend.normalizer))
        if type(model).__name__ != "BPE" or getattr(model, "fuse_unk", False):
            self.why_off = f"model {type(model).__name__} (fused unknowns can cover any length)"
        elif forms is None:
            self.why_off = f"normalizer {_state(backend.normalizer)} (it may shrink text)"
        elif not _keeps_text(_state(backend.pre_tokenizer)):
            self.why_off = "its pre-tokenizer drops text"
        else:
            self.forms = forms
            byte_level = _has(_state(backend.pre_tokenizer), "ByteLevel")
            added = {t.content for t in backend.get_added_tokens_decoder().values()}
            self.max_token_bytes = max((len(k) if byte_level and k not in added else len(k.encode())
                                        for k in self.tokenizer.get_vocab()), default=0)

    def __call__(self, text: str) -> int:
        with self._lock:
            if not self._ready:
                self._read()
                self._ready = True
                if not self.max_token_bytes:
                    log.warning("no token floor for this tokenizer (%s): every prompt is tokenized before its "
                                "length is checked", self.why_off or "empty vocabulary")
        if not self.max_token_bytes:
            return 0
        for form in self.forms:
            if not text.isascii():   # ASCII is unchanged by every normal form
                text = unicodedata.normalize(form, text)
        # a lone surrogate (JSON allows "\ud800") counts as the 3 bytes it is written in
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        return size // self.max_token_bytes
