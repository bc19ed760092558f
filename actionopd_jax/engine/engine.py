"""`Engine`: continuous batching over the paged KV cache, driven by a host scheduler.

`submit` queues a state (prompt ids, N samples, its key); every `step`:
1. admits waiting requests (first come, first served) while N slots and their worst-case pages
   are free: the prompt's cached prefix (prefix index, page-granular) is held, not prefilled;
2. runs up to `chunks_per_step` prefill chunk calls for admitted prompts (`prefill_lanes`
   prompts x `chunk` tokens each), so a long prompt never stalls running rows for long (under
   `run_ahead`, where nothing more is submitted, every admitted prompt before the segment);
3. starts the samples of fully prefilled prompts in their slots (page tables: the prompt's full
   pages shared, the last partial page copied for samples 1..N-1) and runs one segment;
4. retires finished rows: each sample's full pages enter the prefix index (a trajectory's next
   state finds its history there), its own pages are released, and a request whose N samples
   are done goes back to its caller at once (`on_done`).

Weights: the model's parameters are read at every step; when they change (a trainer's update
makes new arrays) the prefix index is cleared before anything else runs -- a cache belongs to
one behaviour snapshot. `load_policy` may swap them while requests run, between steps: running
rows carry on under the new weights and every token records its weights' version
(engine/versions.py); a change made any other way while requests are in flight is an error.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import actionopd_jax.engine.programs as programs
import actionopd_jax.engine.versions as versions
import actionopd_jax.sampling.decode as decode_lib
from actionopd_jax.engine.admission import admit
from actionopd_jax.engine.compiled import Programs
from actionopd_jax.engine.groups import arrange, compact_rows
from actionopd_jax.engine.pages import NULL_PAGE, PagePool, page_keys
from actionopd_jax.engine.pool_fit import engine_needs
from actionopd_jax.engine.requests import EngineStats, Request, pages_needed, validate
from actionopd_jax.engine.sessions import Sessions
from actionopd_jax.engine.slots import host_slots, start_samples
from actionopd_jax.engine.static_api import sample_all
from actionopd_jax.engine.sizing import EngineConfig, engine_attention, pool_pages
from actionopd_jax.sampling.checked_head import checked_head
from actionopd_jax.sampling.sampler import SampleResult, _as_typed_key
from actionopd_jax.sampling.token_choice import DEFAULT_CAP


class Engine:
    """model: a `Qwen3` (parameters read at every step); eos_ids: end tokens; config: the
    fixed shapes (sizing.EngineConfig); lm_head / cap / backend: as `Sampler`'s; mesh: traced
    under when given; reserve_bytes: per-chip memory to leave for state not yet allocated
    (a trainer's), when the pool is sized "auto"."""

    # a prompt's pages read once for up to SHARE_WIDTH of its samples where the paged backend
    # returns mergeable parts (prompt_sharing.py); False reads them per slot (kept to measure)
    share_prompts = True

    def __init__(self, model, cfg=None, *, eos_ids: Sequence[int], config: EngineConfig | None = None,
                 cap: int = DEFAULT_CAP, lm_head: str = "checked", backend: str = "auto", mesh=None,
                 reserve_bytes: int = 0, dtype: str | None = None):
        self.model = model
        self.cfg = cfg if cfg is not None else model.cfg
        self.config = config or EngineConfig()
        self.eos_ids = np.asarray(sorted(set(int(i) for i in eos_ids)) or [-1], np.int32)
        if lm_head not in decode_lib.HEAD_MODES:
            raise ValueError(f"lm_head must be one of {decode_lib.HEAD_MODES}, got {lm_head!r}")
        self.cap, self.lm_head, self.mesh = int(cap), lm_head, mesh
        platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        self.backend = decode_lib.resolve_backend(backend, platform)
        c = self.config
        # the cache's dtype: the model's compute dtype (a model-less engine, loaded by
        # load_policy, is told it: `dtype`, default float32)
        self.dtype = jnp.dtype(model.runtime.dtype if model is not None else (dtype or "float32"))
        self.reserve_bytes = int(reserve_bytes)
        # sized now, or (no model yet, "auto") at the first load_policy: with the rollout copy
        # resident and its mesh known, so the free memory measured is what the pool can take
        self.total_pages, self.pages = None, None
        self.pool_needs: list = []    # XLA's memory analysis of the programs the "auto" pool was sized beside
        self.pool = None   # allocated at the first step (after the weights, so "auto" sizing saw them)
        self._policy: dict[str, tuple] | None = None
        self.stats = EngineStats()
        self.programs = Programs(self.backend, lambda: self.mesh)
        self._next_id = 0
        self.waiting: list[Request] = []
        self.prefilling: list[Request] = []
        self.starting: list[Request] = []
        self.running: dict[int, tuple[Request, int]] = {}     # slot -> (request, sample)
        self._free_slots = list(range(c.slots))
        self.sessions = Sessions()
        self.host = host_slots(c.slots, c.pages_per_slot)
        self._weights: tuple | None = None
        self._loaded = False     # load_policy since the last step: its new weights are expected
        self.version = -1        # what the weights sample is stamped with (engine/versions.py)
        self._split: tuple | None = None
        self._checked: tuple[weakref.ref, Any] | None = None
        if model is not None or c.pages != "auto":
            self._size_pool()

    def _size_pool(self) -> None:
        def needs_at(pages):   # the programs' own needs, before the pool is allocated (pool_fit.py)
            self.pool_needs = engine_needs(self, pages)
            return self.pool_needs

        self.total_pages = pool_pages(self.cfg, self.config, mesh=self.mesh, dtype=str(self.dtype),
                                      reserve_bytes=self.reserve_bytes, needs_at=needs_at)
        self.pages = PagePool(self.total_pages, self.config.page_size)

    # --- submission ------------------------------------------------------------------------
    def submit(self, prompt, *, n: int = 1, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
               top_k: int = 0, key, on_done=None, session=None) -> Request:
        """Queue one state; `key` is its PRNG key (sample j uses fold_in(key, j)). on_done(request)
        runs in the stepping thread as soon as its N samples are done. session: any hashable id
        of the trajectory, to count chat-template misses of the prefix cache (EngineStats)."""
        if self.pages is None:
            raise RuntimeError("the engine has no weights yet: call load_policy(graphdef, params) before submitting")
        prompt = np.asarray(prompt)
        validate(prompt, n=n, max_new=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                 vocab=self.cfg.vocab_size, context=self.cfg.max_position_embeddings, max_len=self.config.max_len,
                 slots=self.config.slots)
        need = sum(pages_needed(prompt.size, int(max_new_tokens), int(n), 0, self.config.page_size)[:2]) + \
            (int(n) - 1) * pages_needed(prompt.size, int(max_new_tokens), int(n), 0, self.config.page_size)[2]
        if need > self.total_pages - 1:
            raise ValueError(f"a state of {prompt.size} prompt tokens, n={n}, max_new_tokens={max_new_tokens} needs "
                             f"{need} pages; the pool has {self.total_pages - 1}: give the engine more pages")
        req = Request(rid=self._next_id, prompt=prompt.astype(np.int32), n=int(n), max_new=int(max_new_tokens),
                      temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), key=_as_typed_key(key),
                      on_done=on_done, session=session)
        self._next_id += 1
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Withdraw a request: its slots and pages are freed at the next step boundary."""
        req.cancelled = True

    def abort(self) -> None:
        """Withdraw every request and start over with an empty cache (after a failed step,
        whose donated pool may be gone)."""
        for req in self.waiting + self.prefilling + self.starting + [r for r, _ in self.running.values()]:
            req.cancelled = True
        self._drop_cancelled()
        self.pool = None
        self.invalidate()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.starting or self.running)

    @property
    def compile_stats(self):
        return self.programs.stats

    @property
    def compile_count(self) -> int:
        return self.programs.stats.programs

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        while self.busy:
            self.step()

    def step(self, run_ahead: bool = False) -> list[Request]:
        """One scheduler round (module docstring); returns the requests finished in it.
        run_ahead: the caller submits nothing while this runs (the static sampler's API), so
        while no request waits to be admitted or prefilled a freed slot has no taker and the
        segment may run up to `EngineConfig.max_segment` steps (fewer program calls); on the
        CPU backend it ends early where the rows still running fit a smaller row count's
        program (`programs.row_buckets`), as a plain segment boundary would let them."""
        if self.model is None:
            raise RuntimeError("the engine has no weights yet: call load_policy(graphdef, params) first")
        if self.pool is None:
            self.pool = programs.empty_pool(self.cfg, self.total_pages, self.config.page_size, self.dtype, self.mesh)
        # one split per step (the programs' arguments and the weight check): nnx.split and the
        # state walk cost milliseconds of host time each, per call
        self._split = nnx.split(self.model)
        self._check_weights(self._split[1])
        finished = self._drop_cancelled()
        self._admit()
        self._prefill()
        while run_ahead and self.prefilling:
            # nothing more is submitted (the static sampler's API): every admitted prompt is
            # prefilled before the segment. On accelerators a segment computes every slot, so
            # one run while prompts still wait pays for rows that produce nothing (the device
            # check's 64 prompts: 3 of every 4 slots idle in its first segment)
            self._prefill()
        if self.running or self.starting:
            finished += self._segment(run_ahead and not self.waiting and not self.prefilling)
        return finished

    # --- weights ----------------------------------------------------------------------------
    def _check_weights(self, state) -> None:
        leaves = tuple(id(x) for x in jax.tree.leaves(state))
        if self._weights is not None and leaves != self._weights:
            if (self.prefilling or self.starting or self.running) and not self._loaded:
                raise RuntimeError("the model's weights changed while requests were running in the engine, not "
                                   "through load_policy; swap weights with load_policy between steps")
            self.invalidate()
        self._loaded = False
        self._weights = leaves

    def load_policy(self, graphdef, params, mesh=None, version: int | None = None) -> None:
        """Sample from `params` of `graphdef` from the next step on (`Sampler.load_policy`'s
        contract and checks), also while requests run: they carry on under the new weights,
        whose tokens are stamped `version` (engine/versions.py). The prefix cache is dropped at
        the next step (new weight arrays). Call it from the thread that steps the engine."""
        versions.load_policy(self, graphdef, params, mesh, version)

    def invalidate(self) -> None:
        """Drop the prefix cache (a weight update: the cached keys/values belong to the old weights)."""
        if self.pages is None:
            return
        self.pages.clear_index()
        self.sessions.clear()

    # --- admission ----------------------------------------------------------------------------
    def _admit(self) -> None:
        admitted = admit(self.waiting, self._free_slots, self.pages, self.config.page_size, self.stats, self.sessions)
        for req in admitted:
            req.version = self.version
        self.prefilling += admitted

    # --- prefill ------------------------------------------------------------------------------
    def _prefill(self) -> None:
        c = self.config
        for _ in range(c.chunks_per_step):
            lanes = [r for r in self.prefilling if r.prefilled < r.prompt.size][:c.prefill_lanes]
            if not lanes:
                break
            tokens = np.zeros((c.prefill_lanes, c.chunk), np.int32)
            start = np.zeros(c.prefill_lanes, np.int32)
            n_valid = np.zeros(c.prefill_lanes, np.int32)
            table = np.zeros((c.prefill_lanes, c.pages_per_slot), np.int32)
            for lane, req in enumerate(lanes):
                take = min(c.chunk, req.prompt.size - req.prefilled)
                tokens[lane, :take] = req.prompt[req.prefilled:req.prefilled + take]
                start[lane], n_valid[lane] = req.prefilled, take
                table[lane, :len(req.prompt_pages)] = req.prompt_pages
            t0 = time.perf_counter()
            args = (*self._split, self.pool, tokens, start, n_valid, table)
            # lanes that all start a prompt skip the decode kernel (programs.FRESH_PREFILL)
            fresh = self.attention() in programs.FRESH_PREFILL and not start.any()
            static = {"page_size": c.page_size, "attention": self.attention(), **({"fresh": True} if fresh else {})}
            self.pool, hidden = self._run("chunk_fresh" if fresh else "chunk", programs.prefill_chunk, args, static,
                                          donate=(2,))
            hidden = np.asarray(hidden)
            self.stats.prefill_s += time.perf_counter() - t0
            self.stats.chunk_calls += 1
            for lane, req in enumerate(lanes):
                req.prefilled += int(n_valid[lane])
                self.stats.prefilled_tokens += int(n_valid[lane])
                if req.prefilled == req.prompt.size:
                    req.hidden = hidden[lane]
                    self._index_pages(req, req.prompt, req.prompt_pages)
                    self.prefilling.remove(req)
                    self.starting.append(req)

    def _index_pages(self, req: Request, tokens: np.ndarray, pages, first: int = 0) -> None:
        """Cache the full pages of `tokens` from page `first` on, unless they were computed
        under weights swapped out since `req` was admitted (versions.indexable)."""
        if not versions.indexable(self, req):
            return
        keys = page_keys(tokens, self.config.page_size)
        for k in range(first, min(len(keys), len(pages))):
            self.pages.index.insert(keys[k], int(pages[k]))

    # --- segments -------------------------------------------------------------------------------
    def shares_prompts(self) -> bool:
        return self.share_prompts and self.attention() in programs.SHARED_ATTENTION

    def _segment_rows(self) -> tuple[np.ndarray, programs.Groups | None]:
        """The slots this segment's program runs on, in order, and their prompt sharing.
        Accelerators: every slot (one program, the shape the AOT numbers are for). The CPU
        backend: only as many rows as hold the running slots (a program per
        `programs.row_buckets` size; a step's cost is per row there). Where the attention
        backend merges passes (programs.SHARED_ATTENTION), groups.arrange lays the rows out so
        that a prompt's samples read its pages together."""
        c = self.config
        every = None if self.backend == "cpu" else c.slots
        if self.shares_prompts():
            return arrange(self.running, self.host["table"], c, n_rows=every)
        if every:
            return np.arange(c.slots), None
        return compact_rows(self.running, c.slots), None

    def _segment(self, run_ahead: bool = False) -> list[Request]:
        c, h = self.config, self.host
        fresh, fresh_hidden, copy_src, copy_dst = start_samples(
            self.starting, h, self.running, page_size=c.page_size, hidden_size=self.cfg.hidden_size, dtype=self.dtype)
        self.starting = []
        rows, groups = self._segment_rows()
        row_of = {int(slot): i for i, slot in enumerate(rows)}
        slots = programs.Slots(fresh=fresh[rows], fresh_hidden=fresh_hidden[rows], **{k: v[rows] for k, v in h.items()})
        t0 = time.perf_counter()
        args = (*self._split, self._checked_head(), self.pool, slots, copy_src, copy_dst, self.eos_ids)
        limit = np.int32(c.max_segment if run_ahead else c.segment)
        stop_below = 0
        if run_ahead and self.backend == "cpu":
            # stop where the rows left fit a smaller row count's program (below the running
            # count itself, so a segment always makes progress)
            stop_below = max((b for b in programs.row_buckets(c.slots) if b < len(self.running)), default=0)
        args += (groups, limit, np.int32(stop_below))
        static = {"steps": c.max_segment, "page_size": c.page_size, "cap": self.cap, "head": self.lm_head,
                  "backend": self.backend, "attention": self.attention()}
        self.pool, out = self._run(f"segment{rows.size}", programs.segment, args, static, donate=(3,))
        out = jax.device_get(out)
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.segments += 1
        self.stats.head_fallback_steps += int(out.head_fallbacks)
        self.stats.decode_row_steps += int(out.produced.max()) * len(self.running)
        for name in h:
            h[name][rows] = np.asarray(getattr(out.slots, name))
        finished = []
        for slot, (req, j) in list(self.running.items()):
            i = row_of[slot]
            k = int(out.produced[i])
            req.tokens[j] += out.tokens[i, :k].tolist()
            req.logprobs[j] += out.logprobs[i, :k].tolist()
            req.versions[j] += [self.version] * k
            self.stats.generated_tokens += k
            if h["done"][slot]:
                req.stopped[j] = bool(h["stopped"][slot])
                if self._retire(slot, req, j):
                    finished.append(req)
        return finished

    def _retire(self, slot: int, req: Request, j: int) -> bool:
        """Free a finished sample's slot; True when it was its request's last one."""
        c = self.config
        del self.running[slot]
        seq = np.concatenate([req.prompt, np.asarray(req.tokens[j][:-1], np.int32)])
        table = self.host["table"][slot]
        full = req.prompt.size // c.page_size
        if not req.cancelled:
            self._index_pages(req, seq, table, full)
            self.sessions.sample_done(req, j)
        own = ([req.prompt_pages[full]] if j == 0 and req.prompt.size % c.page_size else []) + req.own_pages[j]
        self.pages.release(own)
        self.host["table"][slot] = NULL_PAGE
        self.host["lengths"][slot], self.host["done"][slot] = 0, True
        self._free_slots.append(slot)
        self._free_slots.sort()
        req.finished[j] = True
        if not req.done:
            return False
        self.pages.release(req.prompt_pages[:full])
        if req.on_done is not None and not req.cancelled:
            req.on_done(req)
        return True

    def _drop_cancelled(self) -> list[Request]:
        """Withdrawn requests leave at the step boundary: a running one's slots are free for
        this step's segment (a disconnected client costs at most one segment)."""
        self.waiting = [r for r in self.waiting if not r.cancelled]
        for group in (self.prefilling, self.starting):
            for req in [r for r in group if r.cancelled]:
                group.remove(req)
                self.pages.release(req.prompt_pages + [p for own in req.own_pages for p in own])
                self._free_slots = sorted(self._free_slots + req.slots)
                req.finished = [True] * req.n
        for slot, (req, j) in list(self.running.items()):
            if req.cancelled:
                self._retire(slot, req, j)
        return []

    # --- compiled programs --------------------------------------------------------------------
    def _run(self, kind, fn, args, static, donate=()):
        return self.programs.run(kind, fn, args, static, weights=self._weights, donate=donate)

    def attention(self) -> str:
        """The paged-attention backend the programs run (`EngineConfig.attention` resolved for
        the mesh's platform); "live" is the gather path's CPU form (paged_live.py)."""
        platform = self.mesh.devices.flat[0].platform if self.mesh is not None else jax.default_backend()
        return engine_attention(self.config.attention, platform, self.backend)

    def _checked_head(self):
        if not decode_lib.uses_checked_head(self.model, self.lm_head, self.backend):
            return None
        w = self.model.head_weight()
        if self._checked is None or self._checked[0]() is not w:
            self._checked = (weakref.ref(w), jax.jit(checked_head)(w))
        return self._checked[1]

    # --- the static sampler's API ----------------------------------------------------------------
    def sample(self, prompts, *, n=1, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, key) -> SampleResult:
        """`Sampler.sample`'s contract (same keys, same results), through the engine."""
        return sample_all(self, prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, key=key)


__all__ = ["Engine"]
