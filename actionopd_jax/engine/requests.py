"""What the engine knows of one request (a state and its N samples), and its statistics."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import numpy as np

from actionopd_jax.sampling.sampler import Generation


@dataclasses.dataclass
class EngineStats:
    segments: int = 0
    chunk_calls: int = 0
    decode_row_steps: int = 0      # slot-steps of the segments that ran (slots x steps run)
    generated_tokens: int = 0
    prompt_tokens: int = 0         # prompt tokens of admitted requests
    prefilled_tokens: int = 0      # of which prefilled (the rest came from the prefix cache)
    prefix_hit_tokens: int = 0
    # a session's next prompt that is not its previous prompt + one sample + more (the chat
    # template rewrote the history, e.g. Qwen3 dropping earlier reasoning): the count, and the
    # previous tokens that could not be reused because of it
    template_misses: int = 0
    template_miss_tokens: int = 0
    head_fallback_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def slot_utilisation(self) -> float:
        return self.generated_tokens / self.decode_row_steps if self.decode_row_steps else 1.0


@dataclasses.dataclass
class Request:
    """One submitted state. Sample j's key is fold_in(key, j) (the static sampler's rule)."""

    rid: int
    prompt: np.ndarray
    n: int
    max_new: int
    temperature: float
    top_p: float
    top_k: int
    key: jax.Array
    on_done: Callable[["Request"], Any] | None = None
    session: Any = None
    # filled in by the engine
    prompt_pages: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    prefilled: int = 0
    slots: list[int] = dataclasses.field(default_factory=list)
    own_pages: list[list[int]] = dataclasses.field(default_factory=list)   # per sample
    copy_page: list[int | None] = dataclasses.field(default_factory=list)  # per sample: COW copy of the partial page
    hidden: Any = None
    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    stopped: list[bool] = dataclasses.field(default_factory=list)
    finished: list[bool] = dataclasses.field(default_factory=list)
    cancelled: bool = False
    # the weights' versions (engine/versions.py): the one it was admitted under (its prompt's keys
    # and values), each generated token's (the weights that sampled it), per sample
    version: int = -1
    versions: list[list[int]] = dataclasses.field(default_factory=list)
    cache_epoch: int = 0     # the prefix cache it was admitted under (PagePool.stats.invalidations)

    @property
    def generations(self) -> list[Generation]:
        return [Generation(token_ids=np.asarray(t, np.int32), logprobs=np.asarray(lp, np.float32),
                           finish_reason="stop" if s else "length", versions=np.asarray(v, np.int32))
                for t, lp, s, v in zip(self.tokens, self.logprobs, self.stopped, self.versions)]

    @property
    def oldest_version(self) -> int:
        """The oldest weights its samples depend on: those it was admitted under (a row running
        across a swap keeps the keys and values computed before it)."""
        return min([self.version] + [min(v) for v in self.versions if v])

    @property
    def done(self) -> bool:
        return bool(self.finished) and all(self.finished)


def pages_needed(prompt_len: int, max_new: int, n: int, hits: int, page_size: int) -> tuple[int, int, int]:
    """(new prompt pages, pages of sample 0 beyond the prompt's, pages of each other sample).
    A slot holds at most prompt + max_new - 1 tokens (the last token is never fed back); the
    prompt's last partial page is sample 0's, the other samples get a copy of it."""
    prompt_pages = math.ceil(prompt_len / page_size)
    total = math.ceil((prompt_len + max_new - 1) / page_size)
    extra = total - prompt_pages
    partial = 1 if prompt_len % page_size else 0
    return prompt_pages - hits, extra, extra + partial


def validate(prompt: np.ndarray, *, n: int, max_new: int, temperature: float, top_p: float, top_k: int,
             vocab: int, context: int, max_len: int, slots: int, index: int = 0) -> None:
    """The static sampler's checks, plus the engine's shapes (clear errors, what to change)."""
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt {index} must be a non-empty 1-D array of token ids, got {prompt.dtype}{prompt.shape}")
    if prompt.min() < 0 or prompt.max() >= vocab:
        raise ValueError(f"prompt {index} has token ids outside [0, {vocab})")
    if int(n) < 1 or int(max_new) < 1:
        raise ValueError(f"prompt {index}: n and max_new_tokens must be >= 1")
    if not float(temperature) >= 0.0:
        raise ValueError(f"prompt {index}: temperature must be >= 0 (0 = greedy)")
    if not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"prompt {index}: top_p must be in (0, 1]")
    if int(top_k) < 0:
        raise ValueError(f"prompt {index}: top_k must be >= 0 (0 = off)")
    total = prompt.size + int(max_new)
    if total > context:
        raise ValueError(f"prompt {index}: {prompt.size} prompt + {max_new} new tokens exceed the model's context "
                         f"of {context}")
    if total - 1 > max_len:
        raise ValueError(f"prompt {index}: {prompt.size} prompt + {max_new} new tokens exceed the engine's "
                         f"max_len of {max_len} tokens per slot; build the engine with a larger max_len")
    if int(n) > slots:
        raise ValueError(f"prompt {index}: n={n} samples exceed the engine's {slots} slots; use more slots")


__all__ = ["EngineStats", "Request", "pages_needed", "validate"]
