"""The host side of the engine's segment rows: which slots a segment runs, in which order,
and which of them read their prompt's pages together (prompt_sharing.Groups).

On the CPU backend a step costs about the same per row whatever the row holds, so a segment
runs only as many rows as hold its running slots (`programs.row_buckets`), and the rows are
laid out in blocks of SHARE_WIDTH: a block may hold up to SHARE_WIDTH samples of one request,
whose queries then read the prompt's whole pages in one pass. The layout is fixed by
reshaping (row r is member r % SHARE_WIDTH of block r // SHARE_WIDTH), so the program gathers
no queries and selects no branch. A sample's tokens do not depend on its row (its keys are
its own), only on its pages.
"""

from __future__ import annotations

import numpy as np

import actionopd_jax.engine.programs as programs
from actionopd_jax.engine.pages import NULL_PAGE


def row_count(n_running: int, n_slots: int) -> int:
    """Rows a segment with `n_running` running slots runs: the smallest `row_buckets` size."""
    return next(b for b in programs.row_buckets(n_slots) if b >= n_running)


def compact_rows(running: dict, n_slots: int) -> np.ndarray:
    """The running slots first, padded with idle ones to `row_count` rows."""
    busy = sorted(running)
    idle = [s for s in range(n_slots) if s not in running][:row_count(len(busy), n_slots) - len(busy)]
    return np.asarray(busy + idle, np.int64)


def arrange(running: dict, table: np.ndarray, config,
            n_rows: int | None = None) -> tuple[np.ndarray, programs.Groups]:
    """running: slot -> (request, sample); table: every slot's page table. Returns the rows
    (slot ids: `n_rows` of them, default `row_count`; accelerators run every slot) and their
    Groups: each request with two or more
    running samples and a whole prompt page gets a block per SHARE_WIDTH of them (the largest
    first, while blocks are left); the other samples (singles) fill the free rows and read
    all their pages in their own pass."""
    c, width = config, programs.SHARE_WIDTH
    n_rows = n_rows or row_count(len(running), c.slots)
    n_blocks = n_rows // width
    by_request: dict[int, list[int]] = {}
    for slot in sorted(running):
        req = running[slot][0]
        by_request.setdefault(req.rid, []).append(slot)
    chunks, singles = [], []          # chunks: (slots, request, whole prompt pages)
    for slots in by_request.values():
        req = running[slots[0]][0]
        full = req.prompt.size // c.page_size
        for i in range(0, len(slots), width):
            part = slots[i:i + width]
            if full and len(part) > 1:
                chunks.append((part, req, full))
            else:
                singles += part
    chunks.sort(key=lambda ch: -len(ch[0]))
    singles += [s for part, _, _ in chunks[n_blocks:] for s in part]
    chunks = chunks[:n_blocks]

    pps = c.pages_per_slot
    g_table = np.full((n_blocks, pps), NULL_PAGE, np.int32)
    length = np.zeros(n_blocks, np.int32)
    rows = np.full(n_rows, -1, np.int64)
    own_start = np.zeros(n_rows, np.int32)
    for b, (part, req, full) in enumerate(chunks):
        g_table[b, :full] = req.prompt_pages[:full]
        length[b] = full * c.page_size
        rows[b * width:b * width + len(part)] = part
        own_start[b * width:b * width + len(part)] = full * c.page_size
    fill = iter(singles + [s for s in range(c.slots) if s not in running])   # then idle slots
    for r in np.flatnonzero(rows < 0):
        rows[r] = next(fill)
    own_table = table[rows].copy()
    for r in np.flatnonzero(own_start):
        skip = own_start[r] // c.page_size
        own_table[r] = NULL_PAGE
        own_table[r, :pps - skip] = table[rows[r], skip:]
    return rows, programs.Groups(table=g_table, length=length, own_start=own_start, own_table=own_table)


__all__ = ["arrange", "compact_rows", "row_count"]
