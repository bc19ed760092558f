"""Fixed-size key/value cache for incremental decoding.

One write index shared by all rows: batches are left-padded so that every row's newest token
sits in the same slot.  `valid` marks slots that hold a real (non-pad) token; attention reads
all valid slots at or before the query's own slot.  Positions (for RoPE) are passed by the
caller: for a left-padded batch, positions = clip(cumsum(attention_mask, -1) - 1, 0).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from actionopd_jax.model.config import Qwen3Config


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, KVH, Dh]
    v: jax.Array  # [L, B, S, KVH, Dh]
    valid: jax.Array  # bool [B, S]
    index: jax.Array  # int32 []: next slot to write

    @classmethod
    def init(cls, cfg: Qwen3Config, batch: int, max_len: int, dtype=None) -> "KVCache":
        """An empty cache for `batch` rows of up to `max_len` tokens (prompt + generated), in
        `dtype` (the model's compute dtype, `model.runtime.dtype`; None: float32)."""
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"KVCache.init needs batch > 0 and max_len > 0, got {batch}, {max_len}")
        dt = jnp.dtype(dtype or "float32")
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt),
                   valid=jnp.zeros((batch, max_len), bool), index=jnp.zeros((), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def left_pad_positions(attention_mask: jax.Array) -> jax.Array:
    """RoPE positions for a left-padded batch: 0 at the first real token of each row."""
    return jnp.clip(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)
