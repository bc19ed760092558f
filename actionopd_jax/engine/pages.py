"""The host's book of the paged KV cache: which pages are free, who holds them, what they hold.

Pages live on the device (programs.py: per layer k/v [KVH, total_pages, page_size, Dh]); this
module only does the accounting, so every decision about memory is plain Python and testable
without a device.

- `PagePool`: page 0 is the null page (unused page-table entries point at it; writes of idle
  slots land there), pages 1.. are allocated. Each page has a refcount: the N samples of a
  state hold the prompt's pages together; a page returns to the free list when its last holder
  lets go, unless the prefix index keeps it (then it is *evictable*, least recently used first).
- `PrefixIndex`: full pages keyed by the token ids that lead up to and fill them, chained
  (key of page k = digest(key of page k-1, page k's ids)), so a lookup walks a new prompt's
  pages from the start and stops at the first miss: the longest cached prefix, page-granular.
  A cache belongs to one behaviour snapshot: `clear()` on every weight update.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """Fewer free (or evictable) pages than asked for."""


def page_keys(tokens: np.ndarray, page_size: int, n_pages: int | None = None) -> list[bytes]:
    """Chained digests of the first n_pages full pages of `tokens` (default: all full pages)."""
    full = len(tokens) // page_size if n_pages is None else min(n_pages, len(tokens) // page_size)
    ids = np.asarray(tokens, np.int32)
    keys, prev = [], b""
    for k in range(full):
        prev = hashlib.blake2b(prev + ids[k * page_size:(k + 1) * page_size].tobytes(), digest_size=16).digest()
        keys.append(prev)
    return keys


@dataclasses.dataclass
class PoolStats:
    evictions: int = 0          # cached pages dropped to make room
    invalidations: int = 0      # clear() calls (weight updates)
    peak_in_use: int = 0        # most pages held at once (refcount > 0)


class PagePool:
    """Refcounted pages 1..total_pages-1 (module docstring), with the prefix index inside so an
    allocation can evict cached pages when the free list runs dry."""

    def __init__(self, total_pages: int, page_size: int):
        if total_pages < 2 or page_size < 1:
            raise ValueError(f"a page pool needs at least 2 pages (page 0 is the null page) and page_size >= 1, "
                             f"got {total_pages} pages of {page_size}")
        self.total_pages = int(total_pages)
        self.page_size = int(page_size)
        self.refs = np.zeros(self.total_pages, np.int32)
        self.free: collections.deque[int] = collections.deque(range(1, self.total_pages))
        self.index = PrefixIndex()
        self.stats = PoolStats()

    # --- accounting --------------------------------------------------------------------------
    @property
    def in_use(self) -> int:
        return int((self.refs > 0).sum())

    def available(self) -> int:
        """Pages an allocation can get now: free plus evictable."""
        return len(self.free) + self.index.evictable_count()

    def allocate(self, n: int) -> list[int]:
        """n pages with refcount 1, from the free list, else by evicting the least recently
        used cached pages. OutOfPages (nothing taken) when fewer than n are available."""
        if n > self.available():
            raise OutOfPages(f"{n} pages asked for, {self.available()} available of {self.total_pages - 1}")
        pages = []
        for _ in range(n):
            if not self.free:
                self.index.evict_one(self)
                self.stats.evictions += 1
            pages.append(self.free.popleft())
        self.refs[pages] += 1
        self._peak()
        return pages

    def hold(self, pages) -> None:
        """One more holder of each page (a sample sharing a prompt page, a prefix hit)."""
        for p in pages:
            if p == NULL_PAGE:
                continue
            if self.refs[p] == 0:
                self.index.touch_out(p)   # a cached page in use again is no longer evictable
            self.refs[p] += 1
        self._peak()

    def release(self, pages) -> None:
        """One holder fewer; a page nobody holds goes back to the free list unless cached."""
        for p in pages:
            if p == NULL_PAGE:
                continue
            if self.refs[p] <= 0:
                raise RuntimeError(f"page {p} released more often than held")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if self.index.holds(p):
                    self.index.make_evictable(p)
                else:
                    self.free.append(p)

    def clear_index(self) -> None:
        """Forget every cached page (a weight update): the unheld ones are free again, the held
        ones are freed by their holders' release."""
        for p in self.index.clear():
            if self.refs[p] == 0:
                self.free.append(p)
        self.stats.invalidations += 1

    def _peak(self) -> None:
        self.stats.peak_in_use = max(self.stats.peak_in_use, self.in_use)


class PrefixIndex:
    """digest -> page for full pages (module docstring), LRU over the pages nobody holds."""

    def __init__(self):
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()   # evictable, oldest first

    def holds(self, page: int) -> bool:
        return page in self.key_of

    def evictable_count(self) -> int:
        return len(self.lru)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Pages of the longest run of `keys` from the start that is cached."""
        pages = []
        for key in keys:
            page = self.by_key.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def insert(self, key: bytes, page: int) -> bool:
        """Cache `page` (held by the caller) under `key`; False when the key is cached already
        (the caller keeps its own copy unindexed) or the page is indexed under another key."""
        if key in self.by_key or page in self.key_of:
            return False
        self.by_key[key] = page
        self.key_of[page] = key
        return True

    def make_evictable(self, page: int) -> None:
        self.lru[page] = None
        self.lru.move_to_end(page)

    def touch_out(self, page: int) -> None:
        self.lru.pop(page, None)

    def evict_one(self, pool: PagePool) -> None:
        page, _ = self.lru.popitem(last=False)
        del self.by_key[self.key_of.pop(page)]
        pool.free.append(page)

    def clear(self) -> list[int]:
        pages = list(self.key_of)
        self.by_key.clear()
        self.key_of.clear()
        self.lru.clear()
        return pages


__all__ = ["NULL_PAGE", "OutOfPages", "PagePool", "PoolStats", "PrefixIndex", "page_keys"]
