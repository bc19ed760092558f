"""The host's page book (engine/pages.py, requests.pages_needed): chained page keys,
refcounts, the prefix index's LRU eviction and invalidation, worst-case page counts."""

import numpy as np
import pytest

from actionopd_jax.engine import OutOfPages, PagePool, page_keys
from actionopd_jax.engine.requests import pages_needed


def test_page_keys_chain_over_the_whole_prefix():
    a = np.arange(10, dtype=np.int32)
    b = a.copy()
    b[5] = 99                                          # differs in page 1 (tokens 4-7)
    ka, kb = page_keys(a, 4), page_keys(b, 4)
    assert len(ka) == 2                                # 10 tokens: 2 full pages
    assert ka[0] == kb[0] and ka[1] != kb[1]
    c = np.concatenate([np.arange(4), [99, 5, 6, 7]]).astype(np.int32)
    assert page_keys(c, 4)[1] != ka[1]
    # same page contents after a different first page: a different key (the chain)
    assert page_keys(np.r_[np.ones(4), a[4:8]].astype(np.int32), 4)[1] != ka[1]
    assert page_keys(a, 4, n_pages=1) == ka[:1]


def test_refcounts_cache_and_lru_eviction():
    pool = PagePool(total_pages=5, page_size=4)        # pages 1-4; 0 is the null page
    first = pool.allocate(2)
    assert first == [1, 2] and pool.in_use == 2
    pool.hold([1])                                     # a second holder
    pool.release([1])
    assert pool.refs[1] == 1
    assert pool.index.insert(b"k1", 1) and pool.index.insert(b"k2", 2)
    assert not pool.index.insert(b"k1", 3)             # a key is cached once
    pool.release([2])
    pool.release([1])                                  # 2 then 1 become evictable (2 is older)
    assert pool.in_use == 0 and len(pool.free) == 2 and pool.available() == 4
    got = pool.allocate(3)                             # the 2 free pages, then evicts the LRU page 2
    assert got == [3, 4, 2] and pool.stats.evictions == 1
    assert pool.index.lookup([b"k2"]) == [] and pool.index.lookup([b"k1", b"k2"]) == [1]
    with pytest.raises(OutOfPages, match="2 pages asked for, 1 available"):
        pool.allocate(2)
    pool.hold([1])                                     # a prefix hit: no longer evictable
    assert pool.available() == 0
    pool.clear_index()                                 # weight update: held page 1 is freed by its holder
    pool.release([1])
    assert pool.index.lookup([b"k1"]) == [] and pool.free.count(1) == 1
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([1])


def test_pages_needed_hand_counted():
    # prompt 10, max_new 6, pages of 4: prompt pages 3 (the third partial); a slot holds
    # 10 + 6 - 1 = 15 tokens = 4 pages: sample 0 one more, the others a copy + one
    assert pages_needed(10, 6, 4, hits=0, page_size=4) == (3, 1, 2)
    assert pages_needed(10, 6, 4, hits=2, page_size=4) == (1, 1, 2)
    # page-aligned prompt: no partial page to copy
    assert pages_needed(8, 5, 2, hits=0, page_size=4) == (2, 1, 1)
