"""Shape buckets: a run compiles one program per bucket combination, not one per length.

Plain data so a recipe can tune them (e.g. long contexts for tau2, short replies for tests).
A job that always samples the same n with the same max_new (the collector: N candidates per
state) meets only (prompts, prompt_len) combinations; fixing `prompts` to one size (padding
batches up to it) leaves just the prompt-length buckets.
"""

from __future__ import annotations

import dataclasses
import math


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(2 ** i for i in range(int(math.log2(lo)), int(math.log2(hi)) + 1))


@dataclasses.dataclass(frozen=True)
class Buckets:
    # padded prompt length: powers of two, plus the paper's 24,576-token prompt cap (a prompt
    # at the cap would otherwise pad to 32,768: a third more prefill and prompt cache)
    prompt_len: tuple[int, ...] = _powers_of_two(128, 16384) + (24576, 32768)
    prompts: tuple[int, ...] = _powers_of_two(1, 64)          # prompts prefilled together
    samples: tuple[int, ...] = _powers_of_two(1, 64)          # sequences per prompt (n)
    # decode buffer length: coarse (x4), since the loop exits early when every row is done
    max_new: tuple[int, ...] = (64, 256, 1024, 4096, 16384)
    # CPU backend only (accelerators run one phase): generated-cache lengths decode attends
    # over in turn (decode.attention_spans): the per-step attention cost follows the tokens
    # made so far, not the buffer; each span below the buffer adds one copy of the loop body
    # to the program (compile time)
    attention_spans: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    max_rows: int = 256                                       # prompts x samples decoded together

    def __post_init__(self):
        if self.max_rows < 1:
            raise ValueError(f"Buckets.max_rows must be positive, got {self.max_rows}")
        for name in ("prompt_len", "prompts", "samples", "max_new", "attention_spans"):
            values = getattr(self, name)
            if (not values and name != "attention_spans") or any(int(v) <= 0 for v in values) \
                    or list(values) != sorted(set(values)):
                raise ValueError(f"Buckets.{name} must be strictly increasing positive ints, got {values}")

    @staticmethod
    def fit(value: int, buckets: tuple[int, ...], what: str) -> int:
        """Smallest bucket >= value. Beyond the largest, whole multiples of it (so a rare
        long prompt still runs, at the price of one more program)."""
        for b in buckets:
            if value <= b:
                return b
        top = buckets[-1]
        if what in ("prompts", "samples"):
            raise ValueError(f"{value} {what} exceed the largest bucket {top}; the caller must split the batch")
        return top * math.ceil(value / top)


def bucket_length(n: int, multiple: int) -> int:
    """Round n up to a bucket: a multiple of max(multiple, (largest power of 2 <= n) / 4).

    Four buckets per octave: rounding wastes at most ~25% and a run compiles O(log T)
    distinct shapes instead of one per length.
    """
    if n <= 0:
        return multiple
    granularity = max(multiple, (1 << (int(n).bit_length() - 1)) // 4)
    return int(math.ceil(n / granularity) * granularity)
