"""Normalized exact match for communicative replies (messages to the user).

A normalized exact match bypasses the LLM judge, so a false "equal" here is worse than a
missed one (a miss only costs one judge call). The normalization therefore removes only
differences that cannot change meaning:

1. Unicode NFKC (full-width letters, ligatures, compatibility forms -> their plain form);
2. case folding (``str.casefold``);
3. every punctuation character (Unicode category P*) becomes a space, EXCEPT when it touches
   a digit on either side, so ``3.50`` / ``350``, ``-5`` / ``5`` and ``1,000`` / ``1000``
   stay distinct (numbers carry facts);
4. runs of whitespace collapse to one space; leading/trailing whitespace is dropped.

Symbols (currency signs, ``%``, ``+``, ``=``, emoji) are kept: they are not punctuation.
So "Hello, World!" == "hello world", but "It costs $3.50." != "It costs $3.50" (the final
period touches a digit) -- such pairs go to the judge, which is the safe direction.
"""

from __future__ import annotations

import unicodedata


def normalize_message(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    chars = list(text)
    out: list[str] = []
    for i, ch in enumerate(chars):
        if unicodedata.category(ch).startswith("P"):
            prev_digit = i > 0 and chars[i - 1].isdigit()
            next_digit = i + 1 < len(chars) and chars[i + 1].isdigit()
            out.append(ch if (prev_digit or next_digit) else " ")
        else:
            out.append(ch)
    return " ".join("".join(out).split())


def messages_equal(a: str, b: str) -> bool:
    """True when the two texts are equal after `normalize_message`."""
    return normalize_message(a) == normalize_message(b)
