"""Admission: waiting requests (first come, first served) take their slots and pages.

A request is admitted only when its N slots and its worst-case pages are free at once, so an
admitted request never waits for memory mid-flight. Its prompt's cached prefix (the prefix
index, page-granular) is held, not prefilled; the rest of its pages are allocated here and
split into the prompt's new pages and each sample's own (sample 0 keeps the prompt's last
partial page, samples 1..N-1 each get a page to copy it into)."""

from __future__ import annotations

from actionopd_jax.engine.pages import PagePool, page_keys
from actionopd_jax.engine.requests import EngineStats, Request, pages_needed
from actionopd_jax.engine.sessions import Sessions


def admit(waiting: list[Request], free_slots: list[int], pages: PagePool, page_size: int, stats: EngineStats,
          sessions: Sessions) -> list[Request]:
    """Admit from the head of `waiting` while the next request fits (`waiting` and
    `free_slots` are updated in place); returns the admitted requests, in order."""
    admitted = []
    while waiting:
        req = waiting[0]
        if req.n > len(free_slots):
            break
        # the last token is always prefilled
        keys = page_keys(req.prompt, page_size, (req.prompt.size - 1) // page_size)
        hits = pages.index.lookup(keys)
        pages.hold(hits)
        new_prompt, extra0, extra = pages_needed(req.prompt.size, req.max_new, req.n, len(hits), page_size)
        need = new_prompt + extra0 + (req.n - 1) * extra
        if need > pages.available():
            pages.release(hits)
            break
        waiting.pop(0)
        fresh = pages.allocate(need)
        req.prompt_pages = hits + fresh[:new_prompt]
        fresh = fresh[new_prompt:]
        partial = req.prompt.size % page_size != 0
        req.own_pages, req.copy_page = [], []
        for j in range(req.n):
            take = extra0 if j == 0 else extra
            own, fresh = fresh[:take], fresh[take:]
            req.copy_page.append(own[0] if (j > 0 and partial) else None)
            req.own_pages.append(own)
        req.slots = [free_slots.pop(0) for _ in range(req.n)]
        req.cached_tokens = req.prefilled = len(hits) * page_size
        req.tokens = [[] for _ in range(req.n)]
        req.logprobs = [[] for _ in range(req.n)]
        req.versions = [[] for _ in range(req.n)]
        req.cache_epoch = pages.stats.invalidations
        req.stopped = [False] * req.n
        req.finished = [False] * req.n
        stats.prompt_tokens += req.prompt.size
        stats.prefix_hit_tokens += req.cached_tokens
        sessions.admitted(req, stats)
        admitted.append(req)
    return admitted


__all__ = ["admit"]
