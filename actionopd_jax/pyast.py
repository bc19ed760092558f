"""One lock around this process's own Python parsing and compiling of text (`ast.parse`,
`compile`).

CPython 3.11 keeps the AST converter's recursion counter per interpreter, not per thread, so two
threads parsing at once (an MCP server start reading the imports of its code while another
episode is scored, each in an executor thread) can fail with "SystemError: AST constructor
recursion depth mismatch": seen in the suite as an AWM episode whose scoring failed. Our parses
are small and rare, so they take turns. Code that runs in a sandboxed child process is alone
there and needs none of this.

Layer 0: environments, admission and the sandbox's import reader all use it.
"""

from __future__ import annotations

import ast
import threading
from typing import Any

_LOCK = threading.RLock()


def parse(source: str | bytes, filename: str = "<unknown>", mode: str = "exec") -> Any:
    """ast.parse, one thread at a time."""
    with _LOCK:
        return ast.parse(source, filename, mode)


def compile_source(source: str | bytes | ast.AST, filename: str, mode: str = "exec") -> Any:
    """compile, one thread at a time."""
    with _LOCK:
        return compile(source, filename, mode)


def literal_eval(text: str) -> Any:
    """ast.literal_eval of a text, one thread at a time (it parses the text with ast.parse: the
    matcher's execution stage reads tool answers with it while forks start in other threads)."""
    with _LOCK:
        return ast.literal_eval(text)
