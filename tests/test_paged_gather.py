"""The plain paged-attention path (`paged_attention_gather`) equals the model's dense reference
attention (`attend`, reference.py) over the same keys, when those keys sit in a shuffled page
pool: decode queries (q_len 1), a prefill chunk (q_len > 1, causal within it), grouped-query
heads, slots of different lengths, and table entries past a slot's length naming junk pages."""

import jax
import jax.numpy as jnp
import numpy as np

from actionopd_jax.model.attention.paged_gather import gather_pages, paged_attention_gather
from actionopd_jax.model.attention.reference import attend

KVH, G, DH, PAGE, PPS = 2, 3, 8, 4, 5          # 5 pages of 4 tokens per slot: up to 20 tokens


def _pool(lengths, seed=0):
    """Random contiguous k/v per slot [S, C, KVH, Dh] and the same tokens scattered over a
    shuffled pool (page 0 the null page, filled with junk that must never be read)."""
    rng = np.random.default_rng(seed)
    slots, cap = len(lengths), PPS * PAGE
    k = rng.normal(size=(slots, cap, KVH, DH)).astype(np.float32)
    v = rng.normal(size=(slots, cap, KVH, DH)).astype(np.float32)
    total = 1 + slots * PPS
    order = rng.permutation(np.arange(1, total))
    table = np.zeros((slots, PPS), np.int32)
    k_pages = rng.normal(size=(KVH, total, PAGE, DH)).astype(np.float32) * 100  # junk everywhere
    v_pages = rng.normal(size=(KVH, total, PAGE, DH)).astype(np.float32) * 100
    for s, n in enumerate(lengths):
        used = -(-n // PAGE)
        table[s, :used] = order[s * PPS: s * PPS + used]          # the rest stay on null page 0
        for j in range(used):
            k_pages[:, table[s, j]] = k[s, j * PAGE:(j + 1) * PAGE].transpose(1, 0, 2)
            v_pages[:, table[s, j]] = v[s, j * PAGE:(j + 1) * PAGE].transpose(1, 0, 2)
    return k, v, jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(table)


def _dense(q, k, v, lengths, positions):
    """attend() over each slot's contiguous keys with the same causal/length mask."""
    key_pos = np.arange(k.shape[1])
    mask = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < np.asarray(lengths)[:, None, None])
    slots, t = positions.shape
    out = attend(q.reshape(slots, t, KVH, G, DH), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), jnp.float32)
    return np.asarray(out).reshape(slots, t, KVH * G, DH)


def test_gather_pages_restores_the_token_order():
    lengths = [20, 7]
    k, _, k_pages, _, table = _pool(lengths)
    got = np.asarray(gather_pages(k_pages, table))
    np.testing.assert_array_equal(got[0], k[0])
    np.testing.assert_array_equal(got[1, :7], k[1, :7])


def test_decode_step_equals_dense_attention():
    lengths = np.array([1, 9, 20], np.int32)   # one token, a partial last page, a full slot
    k, v, k_pages, v_pages, table = _pool(lengths, seed=1)
    q = jax.random.normal(jax.random.key(2), (3, 1, KVH * G, DH), jnp.float32)
    got = paged_attention_gather(q, k_pages, v_pages, jnp.asarray(lengths), table)
    want = _dense(q, k, v, lengths, (lengths - 1)[:, None])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_prefill_chunk_is_causal_within_the_chunk():
    lengths = np.array([6, 13], np.int32)      # chunks of 4 ending at the slot's length
    k, v, k_pages, v_pages, table = _pool(lengths, seed=3)
    q = jax.random.normal(jax.random.key(4), (2, 4, KVH * G, DH), jnp.float32)
    positions = lengths[:, None] - 4 + np.arange(4)[None, :]
    got = paged_attention_gather(q, k_pages, v_pages, jnp.asarray(lengths), table,
                                 q_positions=jnp.asarray(positions, jnp.int32))
    want = _dense(q, k, v, lengths, positions)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # the default positions are the same last-q_len ones
    default = paged_attention_gather(q, k_pages, v_pages, jnp.asarray(lengths), table)
    np.testing.assert_array_equal(np.asarray(default), np.asarray(got))
    # the first query of slot 0 (position 2) sees 3 keys: changing key 3 leaves it unchanged
    k_pages2 = k_pages.at[:, table[0, 0], 3].set(1e3)
    moved = paged_attention_gather(q, k_pages2, v_pages, jnp.asarray(lengths), table)
    np.testing.assert_array_equal(np.asarray(moved)[0, 0], np.asarray(got)[0, 0])
    assert not np.allclose(np.asarray(moved)[0, 1:], np.asarray(got)[0, 1:])


def test_bad_shapes_are_refused_with_the_reason():
    import pytest

    q = jnp.zeros((2, 1, 4, DH))
    pages = jnp.zeros((3, 5, PAGE, DH))     # 3 KV heads do not divide 4 query heads
    with pytest.raises(ValueError, match="do not group"):
        paged_attention_gather(q, pages, pages, jnp.ones(2, jnp.int32), jnp.zeros((2, 2), jnp.int32))


def test_live_pages_path_equals_dense_attention_and_reads_no_further():
    """The engine's CPU path (paged_live.py): blocks of 2 pages, a loop that stops after the
    longest slot's last block; decode rows and a causal chunk."""
    from actionopd_jax.model.attention.paged_live import paged_attention_live

    lengths = np.array([1, 9, 11], np.int32)   # 3 of the 5 pages at most: blocks 0 and 1 of 3
    k, v, k_pages, v_pages, table = _pool(lengths, seed=5)
    q = jax.random.normal(jax.random.key(6), (3, 1, KVH * G, DH), jnp.float32)
    got = paged_attention_live(q, k_pages, v_pages, jnp.asarray(lengths), table, block_pages=2)
    np.testing.assert_allclose(np.asarray(got), _dense(q, k, v, lengths, (lengths - 1)[:, None]), rtol=1e-5, atol=1e-5)
    # the last block (column 4) is past every slot's length, so it is never read: pointed at
    # pages of NaN keys and values (a read would give NaN through 0 * NaN), nothing changes
    junk = jnp.asarray(sorted(set(range(1, k_pages.shape[1])) - set(np.asarray(table).ravel()))[:3], jnp.int32)
    table_nan = table.at[:, 4].set(junk)
    again = paged_attention_live(q, k_pages.at[:, junk].set(jnp.nan), v_pages.at[:, junk].set(jnp.nan),
                                 jnp.asarray(lengths), table_nan, block_pages=2)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(got))
    # ... while the gather path, which reads every page, is poisoned by them
    assert np.isnan(np.asarray(paged_attention_gather(q, k_pages.at[:, junk].set(jnp.nan),
                                                      v_pages.at[:, junk].set(jnp.nan), jnp.asarray(lengths),
                                                      table_nan))).any()
    q4 = jax.random.normal(jax.random.key(7), (3, 4, KVH * G, DH), jnp.float32)
    lengths4 = np.array([6, 13, 20], np.int32)
    k, v, k_pages, v_pages, table = _pool(lengths4, seed=8)
    positions = lengths4[:, None] - 4 + np.arange(4)[None, :]
    got = paged_attention_live(q4, k_pages, v_pages, jnp.asarray(lengths4), table,
                               q_positions=jnp.asarray(positions, jnp.int32), block_pages=2)
    np.testing.assert_allclose(np.asarray(got), _dense(q4, k, v, lengths4, positions), rtol=1e-5, atol=1e-5)
