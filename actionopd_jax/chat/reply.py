"""The text structure of one model reply: reasoning, visible text, raw tool-call blocks.

Layout (Qwen3 style): optional `<think>...</think>` reasoning (the opening tag may sit in the
prompt, so a reply can start inside the reasoning and only show `</think>`), then visible
text, with tool calls as `<tool_call>\\n{json}\\n</tool_call>` blocks. Everything here is a
linear scan (str.find, one anchored regex that cannot backtrack): untrusted, huge or
malformed replies cannot make it slow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_SURROGATE = re.compile("[\ud800-\udfff]")
# A sampler that decodes special tokens leaves the end-of-turn marker on the reply.
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")
# Turn structure a single reply must not contain: seeing one means the model ran on into a
# turn that is not its own (a hallucinated user or tool message), which is not one action.
_TURN_MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_response>", "</tool_response>")
_REVERSED_END_RUN = re.compile("(?:\\s|" + "|".join(re.escape(m[::-1]) for m in _END_MARKERS) + ")*")


@dataclass
class ReplyParts:
    """A reply split into reasoning, visible text (outside tool-call blocks, stripped) and
    the raw bodies of its tool-call blocks. `error` is set when the layout is malformed."""

    reasoning: str = ""
    text: str = ""
    call_bodies: list[str] = field(default_factory=list)
    error: str | None = None


def replace_lone_surrogates(text: str) -> str:
    """Unpaired UTF-16 surrogates cannot be encoded as UTF-8 (logs, caches, HTTP would fail);
    replace them with U+FFFD. Cheap when the text is clean."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


def has_lone_surrogate(text: str) -> bool:
    return _SURROGATE.search(text) is not None


def strip_end_markers(text: str) -> str:
    """Drop trailing end-of-turn markers and whitespace. Matched on the reversed text from its
    start, so the greedy loop never backtracks: linear even for millions of markers."""
    if not text or not (text[-1].isspace() or text[-1] == ">"):
        return text
    run = _REVERSED_END_RUN.match(text[::-1])
    return text[: len(text) - run.end()]


def split_reasoning(text: str) -> tuple[str, str, str | None]:
    """(reasoning, visible text, error). Every `<think>...</think>` block is removed from the
    visible text; a reply whose first `</think>` comes before any `<think>` started its
    reasoning in the prompt. An unclosed `<think>` is an error (the reply was cut off while
    reasoning). Stray closing tags carry no content and are dropped."""
    reasoning: list[str] = []
    visible: list[str] = []
    first_open, first_close = text.find(THINK_OPEN), text.find(THINK_CLOSE)
    pos = 0
    if first_close >= 0 and (first_open < 0 or first_close < first_open):
        reasoning.append(text[:first_close])
        pos = first_close + len(THINK_CLOSE)
    while True:
        start = text.find(THINK_OPEN, pos)
        if start < 0:
            visible.append(text[pos:])
            break
        end = text.find(THINK_CLOSE, start + len(THINK_OPEN))
        if end < 0:
            return "".join(reasoning), "", "reasoning block opened with <think> is never closed (missing </think>)"
        visible.append(text[pos:start])
        reasoning.append(text[start + len(THINK_OPEN) : end])
        pos = end + len(THINK_CLOSE)
    joined = "".join(visible)
    if THINK_CLOSE in joined:
        joined = joined.replace(THINK_CLOSE, "")
    return "\n".join(part.strip() for part in reasoning).strip(), joined, None


def split_reply(text: str, *, max_calls: int | None = None) -> ReplyParts:
    """Split a raw reply. Scanning stops after `max_calls` complete tool-call blocks (None: all)."""
    text = strip_end_markers(replace_lone_surrogates(text))
    reasoning, visible, error = split_reasoning(text)
    parts = ReplyParts(reasoning=reasoning)
    marker = next((m for m in _TURN_MARKERS if m in text), None)
    if marker:
        error = f"reply contains the chat marker {marker} (it ran on past its own turn)"
    if error:
        parts.error = error
        return parts
    outside: list[str] = []
    pos = 0
    while max_calls is None or len(parts.call_bodies) < max_calls:
        start = visible.find(CALL_OPEN, pos)
        stray = visible.find(CALL_CLOSE, pos, start if start >= 0 else len(visible))
        if stray >= 0:
            parts.error = "found </tool_call> without a matching <tool_call>"
            return parts
        if start < 0:
            break
        end = visible.find(CALL_CLOSE, start + len(CALL_OPEN))
        if end < 0:
            parts.error = "<tool_call> is never closed (missing </tool_call>)"
            return parts
        outside.append(visible[pos:start])
        parts.call_bodies.append(visible[start + len(CALL_OPEN) : end])
        pos = end + len(CALL_CLOSE)
    outside.append(visible[pos:] if max_calls is None or len(parts.call_bodies) < max_calls else "")
    parts.text = "".join(outside).strip()
    return parts
