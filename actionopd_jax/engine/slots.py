"""The decode slots' host-side state (what a segment program reads and writes back, one row
per slot) and the start of a prompt's samples in their slots."""

from __future__ import annotations

import jax
import numpy as np

from actionopd_jax.engine.pages import NULL_PAGE


@jax.jit
def _sample_key_data(prompt_key, samples):
    return jax.random.key_data(jax.vmap(lambda j: jax.random.fold_in(prompt_key, j))(samples))


def host_slots(slots: int, pages_per_slot: int) -> dict[str, np.ndarray]:
    """Every slot empty: page table, cached length, last token, step, done/stopped flags, key
    data and sampling settings (the fields of programs.Slots but the fresh-start ones)."""
    s = slots
    return dict(table=np.zeros((s, pages_per_slot), np.int32), lengths=np.zeros(s, np.int32),
                last=np.zeros(s, np.int32), step=np.zeros(s, np.int32), done=np.ones(s, bool),
                stopped=np.zeros(s, bool), key_data=np.zeros((s, 2), np.uint32),
                temperature=np.ones(s, np.float32), top_k=np.zeros(s, np.int32),
                top_p=np.ones(s, np.float32), max_new=np.zeros(s, np.int32))


def start_samples(starting, host, running, *, page_size: int, hidden_size: int, dtype):
    """Put each prefilled request's N samples in their slots (`host` and `running` updated):
    the prompt's full pages shared by every sample's table, its last partial page kept by
    sample 0 and copied for the others (copy-on-write pairs, real ones first); sample j's key
    is fold_in(key, j). Returns (fresh, fresh_hidden, copy_src, copy_dst), per slot."""
    slots = host["done"].size
    fresh = np.zeros(slots, bool)
    fresh_hidden = np.zeros((slots, hidden_size), dtype)
    copy_src = np.zeros(slots, np.int32)
    copy_dst = np.zeros(slots, np.int32)
    copies = 0
    for req in starting:
        full = req.prompt.size // page_size
        shared, partial_page = req.prompt_pages[:full], req.prompt_pages[full:]
        key_data = np.asarray(_sample_key_data(req.key, np.arange(req.n, dtype=np.int32)))
        for j, slot in enumerate(req.slots):
            mine = partial_page if j == 0 else []
            if req.copy_page[j] is not None:
                copy_src[copies], copy_dst[copies] = partial_page[0], req.copy_page[j]
                copies += 1
            pages = shared + mine + req.own_pages[j]
            host["table"][slot] = NULL_PAGE
            host["table"][slot, :len(pages)] = pages
            host["lengths"][slot], host["last"][slot], host["step"][slot] = req.prompt.size, 0, 0
            host["done"][slot], host["stopped"][slot] = False, False
            host["key_data"][slot] = key_data[j]
            host["temperature"][slot], host["top_k"][slot] = req.temperature, req.top_k
            host["top_p"][slot], host["max_new"][slot] = req.top_p, req.max_new
            fresh[slot] = True
            fresh_hidden[slot] = req.hidden
            running[slot] = (req, j)
    return fresh, fresh_hidden, copy_src, copy_dst


__all__ = ["host_slots", "start_samples"]
