"""Reading a compiled program's HLO text (`compiled.as_text()`) line by line: computation
headers and instruction lines. Shared by train/time_split.py (what each profiled op is) and
benchmarks/hlo_bytes.py (the bytes each instruction moves)."""

from __future__ import annotations

import re

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(")
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_OPCODE = re.compile(r"[\w\-]+")


def computation_header(line: str) -> tuple[str, bool] | None:
    """(name, is the entry computation) where `line` opens a computation, else None."""
    h = _HEADER.match(line)
    return (h.group(2), bool(h.group(1))) if h and line.rstrip().endswith("{") else None


def instruction(line: str) -> tuple[str, str, str, str] | None:
    """(name, shape text, opcode, text after the opcode's "(") of one instruction line, else
    None. A tuple shape is skipped to its closing parenthesis (its /*index=N*/ marks inside)."""
    m = _NAME.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        shape, rest = rest[:i + 1], rest[i + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op, paren, rest = rest.partition("(")
    return (m.group(1), shape, op, rest) if paren and _OPCODE.fullmatch(op) else None


__all__ = ["computation_header", "instruction"]
