"""A paged-engine decode segment compiled ahead of time for TPU v5p-8 on this CPU host.

    python benchmarks/engine_aot.py [--slots 256] [--context 6144] [--page 128] [--steps 16]
    python benchmarks/engine_aot.py --program engine [--attention paged_tpu] ...

`--program ours` (default) compiles a segment program built for this measurement from the
model's own layer modules over a paged KV cache with the "paged_tpu" kernel
(model/attention/paged.py), the reference the engine is held to; `--program engine` compiles
the engine's own segment (engine/programs.py) exactly as the engine does, with its attention
setting. One segment = `--steps` decode steps for every slot: embed the fed token, per layer project
q/k/v, write k/v into the slot's page (one scatter into the pool, in place), attend over the
slot's pages with the Pallas kernel, MLP; then the model's head and the sampler's token
choice (top-k / top-p, traced settings). The pool is one array per k and v for all layers,
[KVH, L * pages, page, Dh]: layer l's pages are [l * pages, (l + 1) * pages), so each layer's
kernel call gets the whole pool and its page table offset by l * pages (no per-layer slice,
which would be a copy).

Sizes: the recipe's (configs/paper/qwen3_4b_tpu.yaml): Qwen3-4B bf16, 64 task starts x N=4 =
256 slots, 24,576-token prompts + 4,096 new at most; the sampler's mesh (tensor over the 4
chips); the pool from what the planner leaves after the trainer's resident state
(train/plan.py: f32 parameters + AdamW moments) and the rollout copy.

Per-step estimate: the compiler's cost model counts a loop body once and cannot see inside a
Pallas kernel (a custom call it costs as nearly free), so
  step = XLA's optimal_seconds of one unrolled step (extrapolated from 2- and 4-layer twins,
         as benchmarks/sampler_aot.py does)
       + the kernel's reads (every slot's pages up to its length, in whole kernel blocks, k and
         v of every layer) at --kernel-efficiency of the HBM bandwidth.
The bound: weights + the live KV tokens of every slot, read once per step, at full bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the host compiles; the target is the topology

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from actionopd_jax.aot.compile import no_persistent_cache  # noqa: E402
from actionopd_jax.model.attention.paged import paged_attention, write_rows  # noqa: E402
from actionopd_jax.model.attention.paged_tpu import pages_per_block  # noqa: E402
from actionopd_jax.model.config import PRESETS, count_params  # noqa: E402
from actionopd_jax.model.layers import rope_tables  # noqa: E402
from actionopd_jax.model.runtime import RuntimeOptions  # noqa: E402
from actionopd_jax.model.sharding import constrain  # noqa: E402
from actionopd_jax.sampling import aot  # noqa: E402
from actionopd_jax.sampling.token_choice import choose_tokens  # noqa: E402
from actionopd_jax.jax_compat import set_mesh

GIB = 2 ** 30


def segment(graphdef, params, pool_k, pool_v, page_table, lengths, last, keys, temperature, top_k, top_p, *,
            steps: int, pages: int, layer_unroll: int = 1):
    """`steps` decode steps of every slot. lengths: tokens in each slot's cache before the
    segment (the fed token `last` goes to position lengths). Returns (pool_k, pool_v, tokens
    [slots, steps], logprobs, lengths after)."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    dt = jnp.dtype(model.runtime.dtype)
    layer_def, layer_state = nnx.split(model.layers)
    page = pool_k.shape[2]
    slots = page_table.shape[0]
    layer_ids = jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)

    def one_step(carry, step):
        pool_k, pool_v, pos, tok = carry
        h = constrain(jnp.take(model.embed_tokens[...], tok[:, None], axis=0).astype(dt),
                      ("batch", "length", "act_embed"))
        cos, sin = rope_tables(pos[:, None], cfg)
        slot_page = jnp.take_along_axis(page_table, (pos // page)[:, None], 1)[:, 0]

        def layer_body(carry, xs):
            h, pool_k, pool_v = carry
            one_layer, l = xs
            layer = nnx.merge(layer_def, one_layer)
            attn = layer.self_attn
            q, k, v = attn.project_qkv(layer.input_layernorm(h), cos, sin)       # [S, 1, heads, Dh]
            at = l * pages + slot_page
            pool_k, pool_v = write_rows(pool_k, at, pos % page, k[:, 0]), write_rows(pool_v, at, pos % page, v[:, 0])
            out = paged_attention(q, pool_k, pool_v, pos + 1, page_table + l * pages, impl="paged_tpu")
            h = h + attn.output(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            return (constrain(h, ("batch", "length", "act_embed")), pool_k, pool_v), None

        (h, pool_k, pool_v), _ = jax.lax.scan(layer_body, (h, pool_k, pool_v), (layer_state, layer_ids),
                                              unroll=layer_unroll)
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
        new, logp = choose_tokens(model.logits(model.norm(h)[:, 0]), step_keys, temperature, top_k, top_p,
                                  active=jnp.ones((slots,), bool))
        return (pool_k, pool_v, pos + 1, new), (new, logp)

    (pool_k, pool_v, pos, _), (tokens, logprobs) = jax.lax.scan(
        one_step, (pool_k, pool_v, lengths, last), jnp.arange(steps, dtype=jnp.int32))
    return pool_k, pool_v, tokens.T, logprobs.T, pos


def compile_segment(cfg, mesh, *, slots, pages, page, pps, steps, layer_unroll=1):
    graphdef, params = aot.abstract_model(cfg, mesh, RuntimeOptions(dtype="bfloat16"))
    sds = lambda shape, dt, spec=P(): jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
    L, kvh, dh = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    pool = sds((kvh, L * pages, page, dh), jnp.bfloat16, P("tensor"))
    key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
    args = (params, pool, pool, sds((slots, pps), jnp.int32), sds((slots,), jnp.int32), sds((slots,), jnp.int32),
            sds((slots,), key_dtype), sds((slots,), jnp.float32), sds((slots,), jnp.int32), sds((slots,), jnp.float32))
    fn = jax.jit(functools.partial(segment, steps=steps, pages=pages, layer_unroll=layer_unroll),
                 static_argnums=(0,), donate_argnums=(2, 3))
    t0 = time.perf_counter()
    with set_mesh(mesh), no_persistent_cache():
        compiled = fn.lower(graphdef, *args).compile()
    return compiled, time.perf_counter() - t0


def compile_engine_segment(cfg, mesh, *, slots, pages, page, pps, steps, attention="paged_tpu"):
    """The engine's own segment program (actionopd_jax/engine/programs.py: one pool array per k
    and v for all layers, a layer scan, page writes and copy-on-write copies as row
    scatters), compiled as the engine compiles it, with its attention setting (the paged
    switch, EngineConfig.attention), with its traced step limit and stop count and token
    buffers `steps x EngineConfig.run_ahead` wide (EngineConfig.max_segment). Its while_loop
    body is one decode step, so the cost model's figures are one step's."""
    import actionopd_jax.engine.programs as programs
    from actionopd_jax.engine.sizing import EngineConfig, engine_attention
    from actionopd_jax.sampling.token_choice import DEFAULT_CAP

    graphdef, params = aot.abstract_model(cfg, mesh, RuntimeOptions(dtype="bfloat16"))
    sds = lambda shape, dt, spec=P(): jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
    pool_kv = sds((cfg.num_key_value_heads, cfg.num_hidden_layers * pages, page, cfg.head_dim), jnp.bfloat16,
                  programs.pool_sharding(mesh, cfg.num_key_value_heads).spec)
    pool = programs.Pool(k=pool_kv, v=pool_kv)
    i32, f32, b = (lambda: sds((slots,), jnp.int32)), (lambda: sds((slots,), jnp.float32)), \
        (lambda: sds((slots,), jnp.bool_))
    state = programs.Slots(table=sds((slots, pps), jnp.int32), lengths=i32(), last=i32(), step=i32(), done=b(),
                           stopped=b(), key_data=sds((slots, 2), jnp.uint32), temperature=f32(), top_k=i32(),
                           top_p=f32(), max_new=i32(), fresh=b(), fresh_hidden=sds((slots, cfg.hidden_size), jnp.bfloat16))
    args = (params, None, pool, state, i32(), i32(), sds((2,), jnp.int32), None, sds((), jnp.int32),
            sds((), jnp.int32))
    impl = engine_attention(attention, "tpu", "accelerator")
    width = steps * EngineConfig().run_ahead
    fn = jax.jit(functools.partial(programs.segment, steps=width, page_size=page, cap=DEFAULT_CAP, head="checked",
                                   backend="accelerator", attention=impl), static_argnums=(0,), donate_argnums=(3,))
    t0 = time.perf_counter()
    with set_mesh(mesh), no_persistent_cache():
        compiled = fn.lower(graphdef, *args).compile()
    return compiled, time.perf_counter() - t0


def _cost(compiled) -> dict:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return {k: float(c.get(k, 0.0)) for k in ("flops", "bytes accessed", "optimal_seconds")}


def collection_plan():
    """(resident trainer bytes, rollout copy bytes, usable bytes) per chip for the recipe, from
    the planner `actionopd train --check` uses."""
    from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION, get_target
    from actionopd_jax.config.load import load_config
    from actionopd_jax.train.plan import estimate_collection

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "paper", "qwen3_4b_tpu.yaml"))
    target = get_target("v5p-8")
    usable = target.hbm_bytes * USABLE_MEMORY_FRACTION
    est = estimate_collection(cfg, PRESETS["qwen3-4b"], {"data": 1, "fsdp": 4, "tensor": 1},
                              chips_per_host=target.chips_per_host, usable_bytes=usable, platform="tpu")
    return est.resident, est.rollout_copy, usable, target.hbm_bytes_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=256, help="decode slots (64 task starts x N=4)")
    ap.add_argument("--context", type=int, default=6144, help="live tokens per slot for the step estimate")
    ap.add_argument("--max-context", type=int, default=24576 + 4096, help="longest slot (pages per slot)")
    ap.add_argument("--page", type=int, default=128, help="tokens per page")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per segment (full-depth compile)")
    ap.add_argument("--pool-gib", type=float, default=0.0, help="pool per chip (0: what the plan leaves)")
    ap.add_argument("--kernel-efficiency", type=float, default=0.86,
                    help="share of HBM bandwidth the paged kernel reaches (0.86: vLLM's TPU kernel authors' report)")
    ap.add_argument("--skip-full", action="store_true", help="skip the full-depth segment compile")
    ap.add_argument("--program", choices=("ours", "engine"), default="ours",
                    help="ours: the segment above; engine: the engine's own programs.segment")
    ap.add_argument("--attention", default="paged_tpu",
                    help="with --program engine: its attention setting (EngineConfig.attention)")
    args = ap.parse_args()

    cfg = PRESETS["qwen3-4b"].replace(param_dtype="bfloat16")
    mesh = aot.tpu_mesh(aot.v5p_topology("v5p:2x2x1"), {"tensor": 4})
    chips = mesh.size
    L, kvh, dh = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    kv_token = 2 * L * kvh * dh * 2                         # bytes of k and v of one token, all layers
    resident, rollout, usable, bw = collection_plan()
    pps = -(-args.max_context // args.page)
    params_chip = count_params(cfg)["total"] * 2 / chips
    free = usable - resident - params_chip
    pool_bytes = args.pool_gib * GIB if args.pool_gib else 0.85 * free   # budget.SAFETY of what is left
    pages = int(pool_bytes * chips // (kv_token * args.page))           # pages per layer, whole pool
    print(f"# Qwen3-4B bf16 paged decode segment on v5p:2x2x1 mesh {dict(mesh.shape)}: {args.slots} slots, "
          f"page {args.page}, {pps} pages per slot, pool {pages} pages = {pages * args.page} tokens "
          f"({pages * args.page / args.slots:.0f} per slot)")
    print(f"per chip: trainer resident (f32 params + AdamW) {resident / GIB:.2f} GiB, rollout copy "
          f"{rollout / GIB:.2f} GiB, usable {usable / GIB:.2f} GiB, pool {pages * args.page * kv_token / chips / GIB:.2f} GiB")
    rows = []
    if args.program == "engine":
        _engine_rows(cfg, mesh, args, pages, pps, resident, usable, bw, kv_token)
        return
    if not args.skip_full:
        full, full_s = compile_segment(cfg, mesh, slots=args.slots, pages=pages, page=args.page, pps=pps,
                                       steps=args.steps)
        mem = aot.memory_gib(full)
        total = mem["peak"] + resident / GIB
        rows += [(f"segment compile, 36 layers x {args.steps} steps (s)", f"{full_s:.1f}"),
                 ("segment per chip: args / out / temp / alias (GiB)",
                  f"{mem['args']:.2f} / {mem['out']:.2f} / {mem['temp']:.2f} / {mem['alias']:.2f}"),
                 ("segment peak + trainer resident per chip (GiB)",
                  f"{mem['peak']:.2f} + {resident / GIB:.2f} = {total:.2f} of {usable / GIB:.2f} usable "
                  f"({'fits' if total <= usable / GIB else 'DOES NOT FIT'})")]
    c = {}
    for n in (2, 4):
        small, _ = compile_segment(cfg.replace(num_hidden_layers=n), mesh, slots=args.slots, pages=pages, page=args.page,
                                   pps=pps, steps=1, layer_unroll=n)
        c[n] = _cost(small)
    per_layer = {k: (c[4][k] - c[2][k]) / 2 for k in c[2]}
    rest = {k: c[2][k] - 2 * per_layer[k] for k in c[2]}
    xla_step = rest["optimal_seconds"] + L * per_layer["optimal_seconds"]
    block = pages_per_block(pps, args.page) * args.page
    read_tokens = args.slots * (-(-args.context // block) * block)      # the kernel reads whole blocks
    kernel_s = read_tokens * kv_token / chips / (args.kernel_efficiency * bw)
    weights = count_params(cfg)["total"] * 2
    bound = (weights + args.slots * args.context * kv_token) / chips / bw
    est = xla_step + kernel_s
    rows += [(f"XLA cost model, one step without the kernel (ms)", f"{1e3 * xla_step:.2f} "
              f"(layers {1e3 * L * per_layer['optimal_seconds']:.2f}, rest {1e3 * rest['optimal_seconds']:.2f}; "
              f"{(rest['bytes accessed'] + L * per_layer['bytes accessed']) / 1e9:.2f} GB)"),
             (f"kernel reads at {args.kernel_efficiency:.0%} of bandwidth (ms)",
              f"{1e3 * kernel_s:.2f} ({read_tokens * kv_token / chips / 1e9:.2f} GB per chip, blocks of {block} tokens)"),
             ("estimated step (ms)", f"{1e3 * est:.2f} ({args.slots / est / chips:.0f} tok/s per chip)"),
             (f"bound: weights + live KV, {args.context} tokens x {args.slots} slots (ms)",
              f"{1e3 * bound:.2f} ({weights / chips / 1e9:.2f} + {args.slots * args.context * kv_token / chips / 1e9:.2f} GB)"),
             ("estimate / bound", f"{est / bound:.2f}")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _engine_rows(cfg, mesh, args, pages, pps, resident, usable, bw, kv_token) -> None:
    compiled, seconds = compile_engine_segment(cfg, mesh, slots=args.slots, pages=pages, page=args.page, pps=pps,
                                               steps=args.steps, attention=args.attention)
    mem, cost, chips = aot.memory_gib(compiled), _cost(compiled), mesh.size
    block = pages_per_block(pps, args.page) * args.page
    read_tokens = args.slots * (-(-args.context // block) * block)
    kernel_s = read_tokens * kv_token / chips / (args.kernel_efficiency * bw)
    weights = count_params(cfg)["total"] * 2
    bound = (weights + args.slots * args.context * kv_token) / chips / bw
    est = cost["optimal_seconds"] + kernel_s
    total = mem["peak"] + resident / GIB
    from actionopd_jax.engine.sizing import EngineConfig

    rows = [(f"engine segment compile, {args.steps} steps ({args.steps * EngineConfig().run_ahead} running ahead) (s)",
             f"{seconds:.1f}"),
            ("segment peak + trainer resident per chip (GiB)",
             f"{mem['peak']:.2f} + {resident / GIB:.2f} = {total:.2f} of {usable / GIB:.2f} usable "
             f"({'fits' if total <= usable / GIB else 'DOES NOT FIT'}; temp {mem['temp']:.2f})"),
            ("XLA cost model, one step (the while body) without the kernel (ms)",
             f"{1e3 * cost['optimal_seconds']:.2f} ({cost['bytes accessed'] / 1e9:.2f} GB)"),
            (f"kernel reads at {args.kernel_efficiency:.0%} of bandwidth (ms)", f"{1e3 * kernel_s:.2f}"),
            ("estimated step / bound (ms)", f"{1e3 * est:.2f} / {1e3 * bound:.2f} = {est / bound:.2f}x")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
