"""What of a reply still being generated can already be streamed: the parts of its
reasoning and content that are certain to begin the finished reply's fields.

The finished reply is parsed as a whole (reply_format.message_fields after the stop-string
cut); a streamed delta can never be taken back, so `ReplyStream` only sends text that no later
token can change:
- a stop string may still start in the last (longest stop - 1) characters: held back;
- a trailing U+FFFD may be a character whose UTF-8 bytes are not all generated yet: held back;
- whitespace at the ends of a field is stripped in the finished reply: trailing whitespace is
  held back until something follows it;
- content stops at the first marker that the finished parse treats specially (`<tool_call>`
  when tools are parsed, `<think>`, `</think>`), and a partial marker or a trailing run of end
  markers (stripped from a finished reply) is held back; what follows a stop is sent with the
  finished reply (tool calls whole).

Known differences from the non-streamed reply (both unusual): a reply cut off inside its
reasoning streams that reasoning as `reasoning_content` (the non-streamed reply has no
reasoning and returns the raw text as content, which the stream then also sends); a `</think>`
written after visible text makes that text reasoning in the non-streamed reply, while the
stream has already sent it as content.
"""

from __future__ import annotations

import re

THINK_OPEN, THINK_CLOSE, CALL_OPEN = "<think>", "</think>", "<tool_call>"
END_MARKERS = ("<|im_end|>", "<|endoftext|>")   # chat/reply.py strips a trailing run of these
_END_RUN = re.compile("(?:\\s|" + "|".join(re.escape(m[::-1]) for m in END_MARKERS) + ")*")


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt leaves a `<think>` block open (templates that start the
    reasoning for the model): the reply then begins inside its reasoning."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def _hold_partial(text: str, markers: tuple[str, ...]) -> str:
    """`text` without a trailing piece that could be the start of one of `markers`."""
    for k in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return text[:-k]
    return text


def safe_fields(text: str, *, opened: bool, parse_tools: bool) -> tuple[str, str]:
    """(reasoning, content) that begin the finished reply's fields, whatever comes after `text`."""
    if opened:
        body, sep, rest = text.partition(THINK_CLOSE)
        if not sep:
            return _hold_partial(body, (THINK_CLOSE,)).strip(), ""
        reasoning, visible = body.strip(), rest
    else:
        lead = text.lstrip()
        if THINK_OPEN.startswith(lead):  # nothing yet, or a reply that may open with <think>
            return "", ""
        if lead.startswith(THINK_OPEN):
            body, sep, rest = lead[len(THINK_OPEN):].partition(THINK_CLOSE)
            if not sep:
                return _hold_partial(body, (THINK_CLOSE,)).strip(), ""
            reasoning, visible = body.strip(), rest
        else:
            reasoning, visible = "", text
    markers = (THINK_OPEN, THINK_CLOSE) + ((CALL_OPEN,) if parse_tools else ())
    cut = min((i for i in (visible.find(m) for m in markers) if i >= 0), default=len(visible))
    content = visible[:cut] if cut < len(visible) else _hold_partial(visible, markers + END_MARKERS)
    # a run of end markers and whitespace is stripped if the reply ends after it: held back
    run = _END_RUN.match(content[::-1])
    return reasoning, content[:len(content) - run.end()].lstrip()


class ReplyStream:
    """One choice's streamed text. `feed(text)` takes the whole reply decoded so far and
    returns the new (field, text) deltas; `stop_hit` turns True once a stop string is in the
    reply for certain (no other stop string can start earlier), so generation can end."""

    def __init__(self, *, stops: list[str] | None, parse_tools: bool, opened: bool = False):
        self.stops = [s for s in stops or [] if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.parse_tools, self.opened = parse_tools, opened
        self.sent = {"reasoning_content": "", "content": ""}
        self.stop_hit = False

    def stable(self, text: str) -> str:
        """The part of `text` that the stop-string cut and later tokens cannot change."""
        end = len(text.rstrip("\ufffd"))
        if self.stops:
            hits = [text.find(s) for s in self.stops if s in text]
            first = min(hits) if hits else None
            if first is not None and len(text) - first >= self.longest:
                self.stop_hit = True  # any stop starting before `first` would be whole in text
                return text[:first]
            end = min(end, len(text) - (self.longest - 1), first if first is not None else len(text))
        return text[:max(end, 0)]

    def feed(self, text: str) -> list[tuple[str, str]]:
        reasoning, content = safe_fields(self.stable(text), opened=self.opened, parse_tools=self.parse_tools)
        out = []
        for field, now in (("reasoning_content", reasoning), ("content", content)):
            sent = self.sent[field]
            if len(now) > len(sent) and now.startswith(sent):
                out.append((field, now[len(sent):]))
                self.sent[field] = now
        return out


def remainder(sent: str, final: str | None) -> str:
    """What a finished field adds to the `sent` part of it ("" when the stream already sent a
    different text: a delta cannot be taken back; the module docstring names the cases)."""
    final = final or ""
    return final[len(sent):] if final.startswith(sent) else ""


__all__ = ["ReplyStream", "prompt_opens_reasoning", "remainder", "safe_fields"]
