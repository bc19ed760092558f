"""Shared-prefix rows: one packed row holds a state's prompt once, then its N candidate
responses in fixed-width regions; a response token sees the prompt and the earlier tokens of
its own response only. The N rows of a state then cost one prompt instead of N (a 24k-token
prompt with 4 x 4k responses: 40k tokens instead of 4 x 28k).

Kernels that take this layout: splash (its mask computed inside the kernel, splash.py) and
the reference path here (the layout's dense [T, T] mask, materialised)."""

from __future__ import annotations

import dataclasses

import numpy as np

import jax.numpy as jnp

from actionopd_jax.model.attention.reference import attend


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    """Layout of a packed row: a prompt region of `prompt` slots, then `count` response regions
    of `response` slots each (every region left-aligned, padding after; padding is excluded by
    the key mask). Static: it is part of the compiled program's shape."""

    prompt: int
    response: int
    count: int

    @property
    def length(self) -> int:
        return self.prompt + self.count * self.response

    def region(self, ids):
        """0 for the prompt, i + 1 for response i (comparisons only: runs inside the kernel)."""
        r = (ids >= self.prompt).astype(np.int32)
        for i in range(1, self.count):
            r = r + (ids >= self.prompt + i * self.response).astype(np.int32)
        return r

    def visible(self, q_ids, kv_ids):
        """Causal, and a response key only for queries of the same response."""
        return (kv_ids <= q_ids) & ((kv_ids < self.prompt) | (self.region(q_ids) == self.region(kv_ids)))

    def dense(self) -> np.ndarray:
        ids = np.arange(self.length, dtype=np.int32)
        return self.visible(ids[:, None], ids[None, :])


def shared_prefix_reference(q, k, v, key_mask, dtype, layout: SharedPrefix):
    """The reference path for shared-prefix rows: the layout's [T, T] mask, materialised."""
    full = jnp.asarray(layout.dense())[None] & key_mask[:, None, :]
    return attend(q, k, v, full, dtype)
