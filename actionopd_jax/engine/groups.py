"""The host side of the CPU engine's prompt sharing (programs.Groups): which running samples
read their prompt's pages together."""

from __future__ import annotations

import numpy as np

import actionopd_jax.engine.programs as programs
from actionopd_jax.engine.pages import NULL_PAGE


def share_groups(running: dict, table: np.ndarray, config) -> programs.Groups:
    """The running samples grouped by request, SHARE_WIDTH at a time, with their prompt's
    whole pages (programs.Groups): on CPU a prompt's pages are read once per group."""
    c = config
    s_count, pps = c.slots, c.pages_per_slot
    width = min(programs.SHARE_WIDTH, s_count)
    member = np.zeros((s_count, width), np.int32)
    g_table = np.full((s_count, pps), NULL_PAGE, np.int32)
    length = np.zeros(s_count, np.int32)
    slot_group, slot_member, own_start = (np.zeros(s_count, np.int32) for _ in range(3))
    own_table = table.copy()
    by_request: dict[int, list[int]] = {}
    for slot, (req, _) in running.items():
        by_request.setdefault(req.rid, [req]).append(slot)
    g = 0
    for req, *slots in by_request.values():
        full = req.prompt.size // c.page_size
        if full == 0:
            continue
        for i in range(0, len(slots), width):
            part = slots[i:i + width]
            member[g] = part + part[:1] * (width - len(part))
            g_table[g, :full] = req.prompt_pages[:full]
            length[g] = full * c.page_size
            for m, slot in enumerate(part):
                slot_group[slot], slot_member[slot], own_start[slot] = g, m, full * c.page_size
                own_table[slot] = NULL_PAGE
                own_table[slot, :pps - full] = table[slot, full:]
            g += 1
    return programs.Groups(member=member, table=g_table, length=length, count=np.int32(g),
                           slot_group=slot_group, slot_member=slot_member, own_start=own_start,
                           own_table=own_table)


__all__ = ["share_groups"]
