"""Fitting a conversation into the model's context budget.

Kept always (the protected part): the system messages, the first user message (the task), the
user message that opened the current turn, the latest exchange (the last assistant tool call
with its results, or the last message), and the full tool schemas. Removable, oldest first:
earlier turns as a whole (a user message with every reply and tool exchange up to the next user
message), then the completed tool exchanges of the current turn (an assistant tool call
together with its tool results). The fewest oldest units are dropped until the prompt fits. If
even the protected part does not fit, the result says so and the episode should end: no action
is fabricated and no schema is truncated.

`count(messages, tools) -> int` is any token counter, e.g. `len(render_ids(tok, m, t))`;
the search assumes dropping more units never makes the prompt longer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from actionopd_jax.types import ChatMessage, ToolSchema

TokenCounter = Callable[[list[ChatMessage], list[ToolSchema]], int]


@dataclasses.dataclass
class FitResult:
    messages: list[ChatMessage]  # what to render (the input list itself when nothing was dropped)
    fits: bool  # False: even the protected part exceeds the budget -> end the episode
    dropped_units: int  # how many removable units were dropped
    dropped_messages: int
    tokens: int  # count() of `messages`


def removable_units(messages: list[ChatMessage]) -> list[list[int]]:
    """Indices of the removable units, oldest first (see module docstring)."""
    n = len(messages)
    user_idx = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    protected = {i for i, m in enumerate(messages) if m.get("role") == "system"}
    if user_idx:
        protected.update({user_idx[0], user_idx[-1]})
    protected.update(_last_exchange(messages))
    current_start = user_idx[-1] if user_idx else 0
    units: list[list[int]] = []
    # Earlier turns, whole: from one user message up to the next (the first turn starts at
    # the first non-system message).
    starts = sorted(set([0] + user_idx))
    for a, b in zip(starts, starts[1:] + [n]):
        if b <= current_start:
            unit = [i for i in range(a, b) if i not in protected]
            if unit:
                units.append(unit)
    # Current turn: each completed exchange (assistant tool call + following tool messages).
    i = current_start
    while i < n:
        m = messages[i]
        if m.get("role") == "assistant" and m.get("tool_calls"):
            j = i + 1
            while j < n and messages[j].get("role") == "tool":
                j += 1
            unit = [k for k in range(i, j) if k not in protected]
            if unit:
                units.append(unit)
            i = j
        else:
            i += 1
    return units


def _last_exchange(messages: list[ChatMessage]) -> set[int]:
    if not messages:
        return set()
    j = len(messages) - 1
    if messages[j].get("role") != "tool":
        return {j}
    while j >= 0 and messages[j].get("role") == "tool":
        j -= 1
    if j >= 0 and messages[j].get("role") == "assistant" and messages[j].get("tool_calls"):
        return set(range(j, len(messages)))
    return set(range(j + 1, len(messages)))


def fit_context(messages: list[ChatMessage], tools: list[ToolSchema], count: TokenCounter, budget: int) -> FitResult:
    """Drop the fewest oldest removable units so that `count(messages, tools) <= budget`."""
    if budget <= 0:
        raise ValueError(f"context budget must be positive, got {budget}")
    total = count(messages, tools)
    if total <= budget:
        return FitResult(messages, True, 0, 0, total)
    units = removable_units(messages)

    def without(k: int) -> list[ChatMessage]:
        gone = {i for unit in units[:k] for i in unit}
        return [m for i, m in enumerate(messages) if i not in gone]

    # Binary search for the smallest k (units dropped, oldest first) that fits.
    lo, hi = 1, len(units)
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        tokens = count(without(mid), tools)
        if tokens <= budget:
            best, hi = (mid, tokens), mid - 1
        else:
            lo = mid + 1
    if best is None:
        kept = without(len(units))
        return FitResult(kept, False, len(units), len(messages) - len(kept), count(kept, tools))
    k, tokens = best
    kept = without(k)
    return FitResult(kept, True, k, len(messages) - len(kept), tokens)
