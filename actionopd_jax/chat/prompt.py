"""From an observation to the prompt both the student and the teacher see, and from the
student's generated ids back to text and an action.

Context budget (paper A.3), by `chat.context.fit_context`: system/task content and the full
tool schemas are protected; the oldest removable exchanges are dropped until the prompt fits.
When even the protected part cannot fit, `build` returns None and the collector ends the
trajectory without fabricating an action. The environment's own history is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from actionopd_jax.types import Action, ChatMessage, Invalid, ToolSchema


@dataclass
class Prompt:
    messages: list[ChatMessage]    # the retained public context (what the teacher receives)
    tools: list[ToolSchema]
    ids: np.ndarray                # int32 token ids of the student's rendered prompt
    dropped_messages: int = 0


# fit(messages, tools) -> (retained messages, their ids) or None when the protected part is too long
FitFn = Callable[[list[ChatMessage], list[ToolSchema]], "tuple[list[ChatMessage], np.ndarray] | None"]


class PromptBuilder:
    """`fit` replaces the context policy (default: `chat.context.fit_context` with the
    rendered token count and `max_prompt_tokens` as the budget)."""

    def __init__(self, tokenizer: Any, *, max_prompt_tokens: int, enable_thinking: bool, fit: FitFn | None = None):
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.enable_thinking = enable_thinking
        self._fit = fit or self._fit_budget

    def render(self, messages: list[ChatMessage], tools: list[ToolSchema]) -> np.ndarray:
        from actionopd_jax.chat.template import render_ids

        return render_ids(self.tokenizer, messages, tools, add_generation_prompt=True,
                          enable_thinking=self.enable_thinking)

    def _fit_budget(self, messages: list[ChatMessage], tools: list[ToolSchema]):
        from actionopd_jax.chat.context import fit_context

        rendered: dict[tuple[int, ...], np.ndarray] = {}  # by message identities: render each candidate once

        def count(msgs: list[ChatMessage], tls: list[ToolSchema]) -> int:
            ids = self.render(msgs, tls)
            rendered[tuple(map(id, msgs))] = ids
            return int(ids.size)

        fit = fit_context(messages, tools, count, self.max_prompt_tokens)
        if not fit.fits:
            return None
        ids = rendered.get(tuple(map(id, fit.messages)))
        return fit.messages, (ids if ids is not None else self.render(fit.messages, tools))

    def build(self, messages: list[ChatMessage], tools: list[ToolSchema]) -> Prompt | None:
        fitted = self._fit(list(messages), list(tools))
        if fitted is None:
            return None
        kept, ids = fitted
        return Prompt(messages=list(kept), tools=list(tools), ids=np.asarray(ids, np.int32),
                      dropped_messages=len(messages) - len(kept))


class CandidateDecoder:
    """Generated ids -> (text, action) under the student's parsing rules."""

    def __init__(self, tokenizer: Any, *, eos_ids: list[int], truncated_is_invalid: bool = True):
        self.tokenizer = tokenizer
        self.eos_ids = {int(i) for i in eos_ids}
        self.truncated_is_invalid = truncated_is_invalid

    def text(self, token_ids: np.ndarray) -> str:
        ids = [int(t) for t in np.asarray(token_ids).reshape(-1)]
        while ids and ids[-1] in self.eos_ids:
            ids.pop()
        # Special tokens stay in the text: a reply that emits <|im_start|> mid-answer is not
        # a clean action and must not be silently cleaned into one.
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def action(self, text: str, tools: list[ToolSchema], finish_reason: str) -> Action:
        from actionopd_jax.chat.actions import parse_student

        if finish_reason == "length" and self.truncated_is_invalid:
            # A reply cut off at max_new_tokens never finished its turn: not one action.
            return Invalid("truncated at max_new_tokens")
        return parse_student(text, tools)
