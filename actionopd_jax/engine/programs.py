"""The engine's two compiled programs: a prefill chunk and a decode segment, over the page pool.

Every shape is fixed when the engine is built (slots, pages per slot, pool size, chunk length,
prefill lanes, segment length), and everything about the requests is traced data, so a change
in the mix of requests never compiles again (on the CPU backend a segment program per row
count, `row_buckets`, each compiled the first time that many rows run).

- `prefill_chunk`: `lanes` prompts, `chunk` tokens each (a lane's real tokens are a prefix of
  it, `n_valid`), at absolute positions `start + [0, chunk)`: their keys/values go straight into
  the lane's pages, attention reads the lane's pages (causal within the chunk), and the
  final-normed hidden state of each lane's last real token comes back (the first token's
  logits are taken from it in the segment that starts the lane's samples).
- `segment`: first, pending copy-on-write page copies, then up to `limit` (<= `steps`) decode
  steps for every running slot, stopping early when all are done or when no more than
  `stop_below` are still running (the engine's run-ahead). A *fresh* slot's first step samples
  its first token from its prompt's hidden state (as the static sampler's prefill does). Each step
  feeds a slot's last token at position `lengths`, writes its key/value into page
  `table[s, pos // page]` at `pos % page` (idle and finished slots write into the null page),
  attends over the slot's pages and picks the next token with key fold_in(row key, step).

Sampling is the static sampler's: the LM-head chooser of `decode.token_chooser` (the
"checked" head on CPU; with lm_head="float32", `choose_tokens` over the model's head, as the
static sampler's first token, for every token) and the same keys, so a
sample does not depend on which slot or segment it ran in (tests/test_engine_exact.py).
One pool array per k and v holds every layer's pages (Pool); page writes and copy-on-write
copies are row scatters of it (paged.write_rows / copy_pages), attention goes through the paged
switch (`attention`: paged.paged_attention's names, or "live", the CPU gather path over live
pages only, paged_live.py). On accelerators a decode step scans the stacked layer weights with
the pool in the carry; on the CPU backend layers are unrolled over the fused output-major step
weights as the static CPU backend does, and the engine runs the segment on only as many rows
as hold its live slots (a program per `row_buckets` size; the host compacts the slots).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

import actionopd_jax.sampling.cpu_backend as cpu_backend
import actionopd_jax.sampling.decode as decode_lib
from actionopd_jax.model.attention.dispatch import SCOPE as ATTENTION_SCOPE, causal_self_attention
from actionopd_jax.model.attention.paged import copy_pages, paged_attention, write_rows
from actionopd_jax.model.attention.paged_live import paged_attention_live
from actionopd_jax.model.layers import rope_tables
from actionopd_jax.model.sharding import constrain
from actionopd_jax.engine.pages import NULL_PAGE
from actionopd_jax.engine.prompt_sharing import SHARE_WIDTH, SHARED_ATTENTION, Groups, shared_attend


@flax.struct.dataclass
class Pool:
    """The paged KV cache: k and v [KVH, L * total_pages, page_size, Dh], one array each for
    all layers; layer l's page p is pool page l * total_pages + p (`layer_tables`), so each
    layer reads and writes the whole pool through offset page tables, never a slice of it (a
    slice or a per-layer array in the loop carry is what made the compiler copy)."""

    k: jax.Array
    v: jax.Array


def pool_sharding(mesh, kv_heads: int):
    """Where the pool lives on `mesh`: KV heads over the "tensor" axis where it divides them
    (the kernels' own split, paged_tpu.tensor_split), whole on every other device; None
    without a mesh (the default device)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from actionopd_jax.model.attention.paged_tpu import tensor_split

    if mesh is None:
        return None
    return NamedSharding(mesh, P(tensor_split(mesh, kv_heads)))


def empty_pool(cfg, total_pages: int, page_size: int, dtype, mesh=None) -> Pool:
    """The zeroed pool, made where it lives (pool_sharding): each device allocates its own
    shard, nothing is built on one device first."""
    shape = (cfg.num_key_value_heads, cfg.num_hidden_layers * total_pages, page_size, cfg.head_dim)
    sharding = pool_sharding(mesh, cfg.num_key_value_heads)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return Pool(k=zeros(), v=zeros())


def layer_pages(pool_pages: jax.Array, cfg) -> int:
    """Pages per layer of a pool array [KVH, L * pages, page, Dh]."""
    return pool_pages.shape[1] // cfg.num_hidden_layers


@flax.struct.dataclass
class Slots:
    """What the host knows of every decode slot, passed in at each segment (small arrays)."""

    table: jax.Array        # i32[S, pages_per_slot]
    lengths: jax.Array      # i32[S]: tokens in the cache (`last` not yet among them)
    last: jax.Array         # i32[S]: the token to feed next
    step: jax.Array         # i32[S]: tokens produced so far
    done: jax.Array         # bool[S]: finished or idle
    stopped: jax.Array      # bool[S]: finished on an end token
    key_data: jax.Array     # u32[S, 2]: the row key fold_in(prompt key, sample)
    temperature: jax.Array  # f32[S]
    top_k: jax.Array        # i32[S]
    top_p: jax.Array        # f32[S]
    max_new: jax.Array      # i32[S]
    fresh: jax.Array        # bool[S]: the slot's first token is still to be sampled
    fresh_hidden: jax.Array  # [S, D]: for fresh slots, the hidden state of the prompt's last token


@flax.struct.dataclass
class SegmentOut:
    tokens: jax.Array       # i32[S, steps + 1]: this segment's tokens per slot (first `produced`)
    logprobs: jax.Array     # f32[S, steps + 1]
    produced: jax.Array     # i32[S]
    slots: Slots            # after the segment
    head_fallbacks: jax.Array   # i32[]: steps where the "checked" head ran the float32 head


def _layer_modules(model):
    layer_def, layer_state = nnx.split(model.layers)
    return [nnx.merge(layer_def, jax.tree.map(lambda x, i=i: x[i], layer_state))
            for i in range(model.cfg.num_hidden_layers)]


# Name scopes a profile sorts the engine's ops by (benchmarks/device_check_split.py, as
# train/time_split.py sorts the update's): attention is model/attention's own scope
KV_WRITE_SCOPE = "kv_write"        # the new keys and values written into their pages
HEAD_SCOPE = "decode_head"         # the LM head and the token chooser


def _attend(q, k_pages, v_pages, lengths, table, *, attention: str, q_positions=None):
    """The paged switch (model/attention/paged.py) with the engine's setting; "gather" on
    the CPU backend reads only the pages live slots have filled (paged_live.py)."""
    with jax.named_scope(ATTENTION_SCOPE):
        if attention == "live":
            return paged_attention_live(q, k_pages, v_pages, lengths, table, q_positions=q_positions)
        return paged_attention(q, k_pages, v_pages, lengths, table, q_positions=q_positions, impl=attention)


def _shared_attend(q, pk, pv, lengths, groups, base: int, attention: str):
    with jax.named_scope(ATTENTION_SCOPE):
        return shared_attend(q, pk, pv, lengths, groups, base, attention)


def _write(pk, pv, at, offset, k, v):
    with jax.named_scope(KV_WRITE_SCOPE):
        return write_rows(pk, at, offset, k), write_rows(pv, at, offset, v)


# paged kernels that read pages for a chunk (paged_gpu: once per block of 16 tokens): a chunk whose
# lanes all start at 0 runs the model's causal attention instead (`fresh`; cuDNN on GPU), which reads
# no pages. benchmarks/engine_cost.py
FRESH_PREFILL = ("paged_gpu",)


def _fresh_attention(setting: str, cfg, dtype, chunk: int) -> str:
    """The model's causal attention for a fresh-prompt chunk; "auto" picking a kernel that cannot
    take it (cuDNN in float32: the device check's parity stage) is "xla" instead of an error."""
    from actionopd_jax.model.attention.dispatch import resolve
    try:
        resolve(setting, seq_len=chunk, heads=(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim),
                dtype=dtype)
    except ValueError:
        if setting != "auto":
            raise
        return "xla"
    return setting


def prefill_chunk(graphdef: nnx.GraphDef, params: Any, pool: Pool, tokens: jax.Array, start: jax.Array,
                  n_valid: jax.Array, table: jax.Array, *, page_size: int, attention: str = "gather",
                  fresh: bool = False) -> tuple[Pool, jax.Array]:
    """tokens i32[lanes, chunk] at positions start[lanes] + [0, chunk), the first n_valid[lanes]
    of them real; table i32[lanes, pages_per_slot]. Returns the pool with their keys/values
    and the final-normed hidden [lanes, D] of each lane's last real token. fresh: the caller
    promises every start is 0 (nothing before the chunk), so attention is the chunk's causal
    self-attention through the model's fused kernel (`model.runtime.attention`), valid keys a
    prefix of each lane; the pages are only written."""
    model = nnx.merge(graphdef, params)
    cfg, dt = model.cfg, jnp.dtype(model.runtime.dtype)
    lanes, chunk = tokens.shape
    positions = start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    valid = jnp.arange(chunk)[None, :] < n_valid[:, None]
    page = jnp.where(valid, jnp.take_along_axis(table, positions // page_size, axis=1, mode="clip"), NULL_PAGE)
    offset = jnp.where(valid, positions % page_size, 0)
    lengths = start + n_valid
    h = jnp.take(model.embed_tokens[...], tokens, axis=0).astype(dt)
    cos, sin = rope_tables(positions, cfg)
    pk, pv = pool.k, pool.v
    per_layer = layer_pages(pk, cfg)
    fresh_impl = _fresh_attention(model.runtime.attention, cfg, dt, chunk) if fresh else None
    keys_seen = valid.at[:, 0].set(True)   # an idle lane (n_valid 0) sees its junk first key: finite
    for i, layer in enumerate(_layer_modules(model)):
        attn = layer.self_attn
        q, k, v = attn.project_qkv(layer.input_layernorm(h), cos, sin)     # [lanes, chunk, heads, Dh]
        at = page + i * per_layer
        pk, pv = _write(pk, pv, at, offset, k, v)
        if fresh:
            out = causal_self_attention(attn.group_queries(q), k, v, keys_seen, dt, fresh_impl, None)
        else:
            out = _attend(q, pk, pv, lengths, table + i * per_layer, attention=attention, q_positions=positions)
        h = h + attn.output(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    last = jnp.maximum(n_valid - 1, 0)
    hidden = jnp.take_along_axis(model.norm(h), last[:, None, None], axis=1)[:, 0]
    return Pool(k=pk, v=pv), hidden


def row_buckets(n_slots: int) -> tuple[int, ...]:
    """Row counts a CPU program is compiled for, up to `n_slots`: 4, 8, 16, ..., n_slots (the
    smallest that holds the live rows runs; engine.Engine compacts them host-side)."""
    sizes, b = [], 4
    while b < n_slots:
        sizes.append(b)
        b *= 2
    return tuple(sizes) + (n_slots,)


COPY_BLOCK = 8   # page copies per loop trip of the copy-on-write pass


def _copy_on_write(pk, pv, copy_src, copy_dst, n_layers: int, per_layer: int):
    """Copy page copy_src[m] to copy_dst[m] in every layer, for the real pairs only: the host
    puts them first (NULL -> NULL pads the rest), and a loop runs ceil(real / COPY_BLOCK) trips,
    so a segment with no sample starting copies nothing (a fixed pass over all `slots` pairs cost
    the compiler's estimate 13.5 ms per segment at the recipe's sizes)."""
    m = copy_src.shape[0]
    block = min(COPY_BLOCK, m)
    padded = -(-m // block) * block
    src = jnp.pad(copy_src, (0, padded - m), constant_values=NULL_PAGE)
    dst = jnp.pad(copy_dst, (0, padded - m), constant_values=NULL_PAGE)
    shift = (jnp.arange(n_layers, dtype=jnp.int32) * per_layer)[:, None]
    real = jnp.sum(dst != NULL_PAGE)

    def trip(b, pools):
        s = (jax.lax.dynamic_slice_in_dim(src, b * block, block)[None] + shift).reshape(-1)
        d = (jax.lax.dynamic_slice_in_dim(dst, b * block, block)[None] + shift).reshape(-1)
        return copy_pages(pools[0], s, d), copy_pages(pools[1], s, d)

    return jax.lax.fori_loop(0, (real + block - 1) // block, trip, (pk, pv))


def _is_end(tokens, end_ids):
    return (tokens[:, None] == end_ids[None, :]).any(-1)


def segment(graphdef: nnx.GraphDef, params: Any, checked: Any, pool: Pool, slots: Slots, copy_src: jax.Array,
            copy_dst: jax.Array, end_ids: jax.Array, groups: Groups | None = None, limit: jax.Array | None = None,
            stop_below: jax.Array | None = None, *, steps: int, page_size: int, cap: int, head: str,
            backend: str, attention: str = "gather", layer_unroll: int | None = None) -> tuple[Pool, SegmentOut]:
    """One decode segment (module docstring). copy_src/copy_dst i32[M]: pages to copy first
    (copy-on-write of a shared prompt's last partial page; pad with NULL_PAGE -> NULL_PAGE).
    groups: prompt sharing (Groups; `attention` one of SHARED_ATTENTION), or None (each slot
    reads its pages).
    limit i32[]: decode steps this call (<= steps, the token buffers' width; None: steps);
    stop_below i32[]: end after the step that leaves at most this many rows running (the
    engine's run-ahead on CPU: the next smaller row count's program is then cheaper; None or
    0: never). Both are traced, so one program serves every segment length. layer_unroll:
    layers per trip of the accelerator's layer scan (the number of layers: no loop, for the
    compiler's cost model, which counts a loop body once: benchmarks/engine_cost.py; None:
    decode.layer_unroll_for's choice: every layer on GPU, whose XLA copies a scanned trip's
    weights out of the stack)."""
    model = nnx.merge(graphdef, params)
    cfg, dt = model.cfg, jnp.dtype(model.runtime.dtype)
    n_slots = slots.last.shape[0]
    width = steps + 1                      # up to `steps` tokens, plus a junk column
    junk = width - 1
    rows = decode_lib.RowSettings(keys=jax.random.wrap_key_data(slots.key_data), temperature=slots.temperature,
                                  top_k=slots.top_k, top_p=slots.top_p, max_new=slots.max_new)
    step_keys = lambda s: jax.vmap(jax.random.fold_in)(rows.keys, s.step)
    per_layer = layer_pages(pool.k, cfg)
    pk, pv = _copy_on_write(pool.k, pool.v, copy_src, copy_dst, cfg.num_hidden_layers, per_layer)
    out_tok = jnp.zeros((n_slots, width), jnp.int32)
    out_lp = jnp.zeros((n_slots, width), jnp.float32)
    produced = jnp.zeros((n_slots,), jnp.int32)

    def record(s: Slots, out_tok, out_lp, produced, tok, logp, running):
        at = jnp.where(running, produced, junk)
        out_tok = out_tok.at[jnp.arange(n_slots), at].set(tok)
        out_lp = out_lp.at[jnp.arange(n_slots), at].set(logp)
        hit_end = running & _is_end(tok, end_ids)
        step = jnp.where(running, s.step + 1, s.step)
        s = s.replace(last=jnp.where(running, tok, s.last), step=step, stopped=s.stopped | hit_end,
                      done=s.done | hit_end | (running & (step >= s.max_new)))
        return s, out_tok, out_lp, produced + running.astype(jnp.int32)

    choose = decode_lib.token_chooser(model, head, cap=cap, backend=backend, checked=checked)
    if backend == "cpu":
        layers = _layer_modules(model)
        fused = [cpu_backend.step_weights(layer) for layer in layers]
    else:
        layer_def, layer_state = nnx.split(model.layers)

    def decoder(h, pk, pv, s, page, offset, cos, sin):
        """The layers of one step: the CPU backend unrolls them over sliced, fused weights
        (cpu_backend.py); accelerators scan the stacked weights, the pool in the carry."""
        pos = s.lengths
        if backend == "cpu":
            for j, layer in enumerate(layers):
                attn = layer.self_attn
                qkv_w, o_w, gate_up_w, down_w = fused[j]
                q, k, v = attn.project_qkv(layer.input_layernorm(h), cos, sin, qkv_w)   # [S, 1, heads, Dh]
                at = page + j * per_layer
                pk, pv = _write(pk, pv, at, offset, k[:, 0], v[:, 0])
                if groups is not None:
                    out = _shared_attend(q, pk, pv, pos + 1, groups, j * per_layer, attention)
                else:
                    out = _attend(q, pk, pv, pos + 1, s.table + j * per_layer, attention=attention)
                h = h + attn.output(out, o_w)
                h = h + layer.mlp(layer.post_attention_layernorm(h), gate_up_w, down_w)
            return h, pk, pv

        def layer_body(carry, xs):
            h, pk, pv = carry
            one_layer, j = xs
            layer = nnx.merge(layer_def, one_layer)
            attn = layer.self_attn
            q, k, v = attn.project_qkv(layer.input_layernorm(h), cos, sin)
            at = page + j * per_layer
            pk, pv = _write(pk, pv, at, offset, k[:, 0], v[:, 0])
            if groups is not None:
                out = _shared_attend(q, pk, pv, pos + 1, groups, j * per_layer, attention)
            else:
                out = _attend(q, pk, pv, pos + 1, s.table + j * per_layer, attention=attention)
            h = h + attn.output(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            return (constrain(h, ("batch", "length", "act_embed")), pk, pv), None

        (h, pk, pv), _ = jax.lax.scan(layer_body, (h, pk, pv),
                                      (layer_state, jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)),
                                      unroll=decode_lib.layer_unroll_for(layer_unroll, cfg.num_hidden_layers))
        return h, pk, pv

    if backend == "cpu":
        # RoPE of every position a slot can reach, once per segment (the static CPU backend's
        # table): computed per step, XLA evaluates it inside each layer's q/k fusions
        reach = slots.table.shape[1] * page_size + 1
        cos_table, sin_table = (t[0] for t in rope_tables(jnp.arange(reach, dtype=jnp.int32)[None], cfg))

    def one_step(carry):
        i, pk, pv, s, out_tok, out_lp, produced, fallbacks = carry
        # fresh slots take their first token from the prompt's hidden state in this step (one
        # chooser in the program, not two); their forward row is junk and writes nothing
        feeding = ~s.done & ~s.fresh
        pos = s.lengths
        page = jnp.where(feeding, jnp.take_along_axis(s.table, (pos // page_size)[:, None], axis=1,
                                                      mode="clip")[:, 0], NULL_PAGE)
        offset = jnp.where(feeding, pos % page_size, 0)
        h = jnp.take(model.embed_tokens[...], s.last[:, None], axis=0).astype(dt)   # [S, 1, D]
        if backend == "cpu":
            cos = jnp.take(cos_table, pos[:, None], axis=0, mode="clip")                # [S, 1, Dh]
            sin = jnp.take(sin_table, pos[:, None], axis=0, mode="clip")
        else:
            cos, sin = rope_tables(pos[:, None], cfg)
        h, pk, pv = decoder(h, pk, pv, s, page, offset, cos, sin)
        hidden = jnp.where(s.fresh[:, None], s.fresh_hidden.astype(dt), model.norm(h)[:, 0])
        running = ~s.done
        with jax.named_scope(HEAD_SCOPE):
            tok, logp, fell_back = choose(hidden, step_keys(s), rows, running)
        s = s.replace(lengths=jnp.where(feeding, pos + 1, pos), fresh=jnp.zeros_like(s.fresh))
        s, out_tok, out_lp, produced = record(s, out_tok, out_lp, produced, tok, logp, running)
        return i + 1, pk, pv, s, out_tok, out_lp, produced, fallbacks + fell_back.astype(jnp.int32)

    s = slots.replace(done=slots.done & ~slots.fresh)
    limit = jnp.minimum(jnp.asarray(steps if limit is None else limit, jnp.int32), steps)
    stop_below = jnp.maximum(jnp.asarray(0 if stop_below is None else stop_below, jnp.int32), 0)

    def go_on(c):                           # (also ends when every row is done: stop_below >= 0)
        return (c[0] < limit) & (jnp.sum(~c[3].done) > stop_below)

    carry = (jnp.zeros((), jnp.int32), pk, pv, s, out_tok, out_lp, produced, jnp.zeros((), jnp.int32))
    _, pk, pv, s, out_tok, out_lp, produced, fallbacks = jax.lax.while_loop(go_on, one_step, carry)
    return Pool(k=pk, v=pv), SegmentOut(tokens=out_tok, logprobs=out_lp, produced=produced, slots=s,
                                        head_fallbacks=fallbacks)


__all__ = ["FRESH_PREFILL", "Groups", "HEAD_SCOPE", "KV_WRITE_SCOPE", "Pool", "SHARED_ATTENTION", "SHARE_WIDTH",
           "SegmentOut", "Slots", "empty_pool", "prefill_chunk", "row_buckets", "segment"]
