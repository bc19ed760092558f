"""Where the engine's device time goes, by XLA's own analyses (no GPU, no weights).

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/engine_cost.py [--rows 64] [--layers 36]

Compiles, for the CPU backend (or an H100 / H200, --target) and Qwen3-4B's shapes at 1 and 2
layers (abstract parameters, float32 by default (--dtype), nothing allocated), the engine's
prefill chunk and decode segment (engine/programs.py, the accelerator path) and the static
sampler's prefill and decode (sampling/decode.py), on issue 41's workload (`--rows` = prompts x
4 samples, prompts of 1,024-4,096 tokens, 256 new). The layers are unrolled: XLA's cost model
counts a loop body once, so a program's figures are one decode step and the per-layer cost is
the 2-layer compile less the 1-layer one, scaled to `--layers`.

Every figure is a COMPILER ESTIMATE (HloCostAnalysis "bytes accessed" and flops; the walk of
benchmarks/hlo_bytes.py, each `lax.cond`'s cheapest branch: they are rare fallbacks) or, where
XLA cannot see into the Pallas kernel, a "kernel model" (the program compiled with its paged
attention left out, plus what the kernel's loops read and its partial results written); never
a device timing. "bound": the bytes one step must read: the weights plus each row's live KV, a
shared prompt read once (issue 41's definition); for prefill the weights once per call plus
the KV written. Also checked: the pool (or static's cache) aliased in place, no pool copies.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from actionopd_jax.engine import programs  # noqa: E402
from actionopd_jax.engine.aot import abstract_pool, abstract_slots  # noqa: E402
from actionopd_jax.engine.sizing import EngineConfig  # noqa: E402
from actionopd_jax.model.attention.paged_gpu import gpu_blocks  # noqa: E402
from actionopd_jax.model.attention.paged_gpu_parts import MIN_QUERIES, QUERY_BLOCK  # noqa: E402
from actionopd_jax.model.attention.paged_live import BLOCK_TOKENS  # noqa: E402
from actionopd_jax.model.config import PRESETS, count_params  # noqa: E402
from actionopd_jax.model.runtime import RuntimeOptions  # noqa: E402
from actionopd_jax.model.sharding import make_mesh  # noqa: E402
import actionopd_jax.sampling.decode as decode_lib  # noqa: E402
from actionopd_jax.sampling.aot import abstract_inputs, abstract_model  # noqa: E402
from actionopd_jax.sampling.token_choice import DEFAULT_CAP  # noqa: E402
from actionopd_jax.aot.targets import target_devices  # noqa: E402
from actionopd_jax.jax_compat import set_mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hlo_bytes import instruction_bytes, program_bytes  # noqa: E402

SAMPLES, NEW, PAGE, CHUNK, LANES = 4, 256, 16, 512, 4
LO, HI = 1024, 4096


def cost(compiled) -> dict:
    """XLA's figures and the walk's. The walk follows each conditional's cheapest branch: every
    `lax.cond` in these programs is a rare fallback (the token chooser's full-vocabulary path,
    the checked head's float32 head), which counting all branches would charge every step."""
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    m = compiled.memory_analysis()
    c = c or {"bytes accessed": None, "flops": None}   # XLA:GPU's compile-only client has none: the walk alone
    return {"bytes": c.get("bytes accessed", 0.0), "flops": c.get("flops", 0.0),
            "walk": program_bytes(compiled.as_text(), branches="cheapest"),
            "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes, "args": m.argument_size_in_bytes}


def _copy_names(compiled, shape: tuple, dtype: str) -> list[str]:
    want = f"{dtype}[{','.join(map(str, shape))}]"
    names = []
    for line in compiled.as_text().splitlines():
        s = line.strip().removeprefix("ROOT ")
        if "=" in s and s.split("=", 1)[1].strip().startswith(want) and re.search(r"\bcopy(-start)?\(", s):
            names.append(s.split("=", 1)[0].strip().lstrip("%"))
    return names


def shape_copies(compiled, shape: tuple, dtype: str) -> int:
    """Copies (copy ops, or copy-rooted fusions) of a `shape` buffer: a pool copied per step."""
    return len(_copy_names(compiled, shape, dtype))


def copies_walk(compiled, shape: tuple, dtype: str) -> float:
    """The walk's bytes for those copies (one pass, cheapest branches, as `cost`)."""
    names = set(_copy_names(compiled, shape, dtype))
    return float(sum(b for b, label in instruction_bytes(compiled.as_text(), branches="cheapest")
                     if label.split("/", 1)[-1].split(" ", 1)[0] in names))


def prompt_lengths(n: int) -> list[int]:   # evenly spread over [1,024, 4,096] (the device check draws them)
    return [LO + (HI - LO) * i // max(1, n - 1) for i in range(n)]


@contextlib.contextmanager
def attention_left_out():
    """Trace the engine's programs with their paged attention replaced by a read of nothing
    (its output is q): compiled so, a program's walk is everything but the attention, which
    the kernel model then adds for a backend the CPU cannot compile (the Pallas GPU kernel)."""
    real = programs._attend
    programs._attend = lambda q, *_, **__: q * 1.0
    try:
        yield
    finally:
        programs._attend = real


def engine_compile(cfg, mesh, shapes: EngineConfig, attention: str, layers: int, which: str, fresh: bool = False,
                   pages: int | None = None, without_attention: bool = False):
    """The engine's prefill chunk ("chunk") or decode segment over an abstract pool of `pages`
    (default: every slot full), compiled for this host; (compiled, pool array shape).
    without_attention: the paged attention left out (attention_left_out)."""
    if without_attention:
        with attention_left_out():
            return engine_compile(cfg, mesh, shapes, attention, layers, which, fresh, pages)
    c = cfg.replace(num_hidden_layers=layers)
    graphdef, params = abstract_model(c, mesh, RuntimeOptions(dtype=c.param_dtype, attention="xla", scan_unroll=0))
    pps = shapes.pages_per_slot
    pool = abstract_pool(c, mesh, pages or shapes.slots * pps + 1, shapes.page_size, dtype=c.param_dtype)
    rep = NamedSharding(mesh, P())
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=rep)  # noqa: E731
    with set_mesh(mesh):
        if which == "chunk":
            fn = jax.jit(functools.partial(programs.prefill_chunk, page_size=shapes.page_size, attention=attention,
                                           **({"fresh": True} if fresh else {})),
                         static_argnums=(0,), donate_argnums=(2,))
            args = (graphdef, params, pool, i32(LANES, shapes.chunk), i32(LANES), i32(LANES), i32(LANES, pps))
        else:
            fn = jax.jit(functools.partial(programs.segment, steps=shapes.max_segment, page_size=shapes.page_size,
                                           cap=DEFAULT_CAP, head="checked", backend="accelerator",
                                           attention=attention, layer_unroll=layers),
                         static_argnums=(0,), donate_argnums=(3,))
            slots = abstract_slots(c, mesh, shapes.slots, pps, c.param_dtype)
            args = (graphdef, params, None, pool, slots, i32(shapes.slots), i32(shapes.slots), i32(2), None, i32(),
                    i32())
        compiled = fn.lower(*args).compile()
    return compiled, pool.k.shape


def static_compile(cfg, mesh, prompts: int, layers: int, which: str, layer_unroll: int | None = None):
    """The static sampler's prefill or decode step at `layers`, its layers unrolled (the cost
    model's view; `layer_unroll`=1: the layer scan the sampler runs)."""
    c = cfg.replace(num_hidden_layers=layers)
    graphdef, params = abstract_model(c, mesh, RuntimeOptions(dtype=c.param_dtype, attention="xla", scan_unroll=0))
    tokens, mask, rows, end_ids = abstract_inputs(mesh, prompts=prompts, prompt_len=HI, samples=SAMPLES)
    pre = jax.jit(functools.partial(decode_lib.prefill, samples=SAMPLES, max_new=NEW, cap=DEFAULT_CAP,
                                    head="checked", backend="accelerator"), static_argnums=(0,))
    with set_mesh(mesh):
        if which == "prefill":
            return pre.lower(graphdef, params, tokens, mask, rows, end_ids).compile(), None
        shapes = jax.eval_shape(pre, graphdef, params, tokens, mask, rows, end_ids)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
                             shapes)
        dec = jax.jit(functools.partial(decode_lib.decode, cap=DEFAULT_CAP, head="checked",
                                        layer_unroll=layer_unroll or layers),
                      static_argnums=(0,), donate_argnums=(2,))
        return dec.lower(graphdef, params, state, rows, end_ids, None).compile(), shapes.gen_k.shape


def per(x: float | None, n: float) -> float | None:
    """x / n, or None where XLA gave no figure (the GPU compile-only client)."""
    return None if x is None else x / n


def scaled(one: dict, two: dict, layers: int) -> dict:
    """Per-program figures at `layers` from the 1- and 2-layer compiles (linear in depth)."""
    return {k: None if one[k] is None else one[k] + (layers - 1) * (two[k] - one[k])
            for k in ("bytes", "flops", "walk")}


def kernel_decode_bytes(lengths: list[int], kv_token_layer: int, layers: int) -> float:
    """What the Pallas GPU kernel reads per step (kernel model): each row's pages up to its
    length, in whole compute blocks (gpu_blocks at the engine's table), k and v, every layer."""
    return sum(math.ceil(n / BLOCK_K[0]) * BLOCK_K[0] for n in lengths) * kv_token_layer * layers


BLOCK_K = [PAGE]
SPLITS = [1]      # the kernels' table partitions (gpu_blocks at the engine's table)


def parts_bytes(programs_rows: int, kv_heads: int, head_dim: int, layers: int, queries: int = MIN_QUERIES) -> float:
    """The kernels' partial results (kernel model): each (row, KV head, partition) writes
    `queries` float32 (acc, top, total) rows, read back once by the merge in jax: a whole
    block of MIN_QUERIES where every row of the block is stored (jax's decode kernel writes the
    same per 16 query heads), the real ones where the store is masked."""
    return 2 * SPLITS[0] * programs_rows * kv_heads * queries * (head_dim + 2) * 4 * layers


def kernel_shared_decode_bytes(prompts: list[int], mid_gen: int, kv_token_layer: int, layers: int,
                               granule: int | None = None) -> float:
    """Kernel model of the decode with prompt sharing (engine/prompt_sharing.py): a prompt's
    whole pages once for its SAMPLES samples, then each row's own keys (the prompt's partial
    last page, copied per sample, and its reply), in units of `granule` keys (default: whole
    compute blocks, every page of a block loaded; 1: the kernel's masked loads, live keys
    only), k and v, every layer."""
    b = granule or BLOCK_K[0]
    total = 0
    for p in prompts:
        shared = p // PAGE * PAGE
        total += math.ceil(shared / b) * b + SAMPLES * math.ceil((p - shared + mid_gen) / b) * b
    return total * kv_token_layer * layers


def kernel_prefill_bytes(prompts: list[int], kv_token_layer: int, layers: int, after: int = 0) -> float:
    """Kernel model of prefill through the decode kernel (query_rows: one kernel row per
    prompt token past `after`, each reading its slot's pages up to its own position)."""
    b = BLOCK_K[0]
    return sum(sum(math.ceil(t / b) * b for t in range(after + 1, n + 1)) for n in prompts) * kv_token_layer * layers


def kernel_prefill_block_bytes(prompts: list[int], group: int, kv_token_layer: int, layers: int,
                               after: int = 0) -> float:
    """Kernel model of prefill chunks past `after` through our kernel (paged_gpu_parts.py):
    each block of QUERY_BLOCK // group tokens reads its slot's pages up to its last token."""
    b, per = BLOCK_K[0], QUERY_BLOCK // group
    return sum(math.ceil(min(n, t + per) / b) * b for n in prompts for t in range(after, n, per)) * \
        kv_token_layer * layers


def live_blocks(prompts: list[int]) -> int:
    """128-key blocks the live path reads over all chunk calls of the workload (per layer, per
    lane), lanes filled in prompt order, a call reading to its longest lane."""
    chunks = [(p, s) for p in prompts for s in range(0, p, CHUNK)]
    total = 0
    for i in range(0, len(chunks), LANES):
        longest = max(min(p, s + CHUNK) for p, s in chunks[i:i + LANES])
        total += math.ceil(longest / BLOCK_TOKENS)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64, help="decode rows (prompts x 4 samples)")
    ap.add_argument("--layers", type=int, default=36, help="scale the per-layer cost to this depth")
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="weights, activations and cache (float32: the CPU compiler runs bf16 scatters and "
                         "gathers through float32 copies of the whole pool and head, which XLA:GPU does not; "
                         "every figure and bound is then in float32 bytes)")
    ap.add_argument("--target", choices=("h100", "h200"),
                    help="compile for this GPU on this host (aot/gpu_topology.py: XLA:GPU's own fusions, cuDNN and "
                         "the Pallas kernels, no GPU needed; XLA gives no cost analysis there, so the walk alone)")
    args = ap.parse_args()
    cfg = PRESETS["qwen3-4b"].replace(param_dtype=args.dtype)
    item = jnp.dtype(args.dtype).itemsize
    hlo_dt = {"float32": "f32", "bfloat16": "bf16"}[args.dtype]
    mesh = make_mesh({"data": 1}, devices=target_devices(f"{args.target}x1")[:1] if args.target else jax.devices()[:1])
    n_prompts = args.rows // SAMPLES
    prompts = prompt_lengths(n_prompts)
    shapes = EngineConfig(slots=args.rows, page_size=PAGE, max_len=HI + NEW, chunk=CHUNK, segment=16)
    SPLITS[0], block_pages = gpu_blocks(shapes.pages_per_slot, PAGE)
    BLOCK_K[0] = block_pages * PAGE
    L = args.layers
    kv_tl = 2 * cfg.num_key_value_heads * cfg.head_dim * item       # k and v of one token, one layer
    n = count_params(cfg)
    weights = (L * n["per_layer"] + cfg.hidden_size) * item + cfg.vocab_size * cfg.hidden_size * item
    mid_gen = NEW // 2
    live_rows = [p + mid_gen for p in prompts for _ in range(SAMPLES)]
    prompt_tokens = sum(prompts)
    calls = math.ceil(sum(math.ceil(p / CHUNK) for p in prompts) / LANES)
    dec_bound = (weights + (prompt_tokens + args.rows * mid_gen) * kv_tl * L) / args.rows
    pre_bound = (weights * calls + prompt_tokens * kv_tl * L) / prompt_tokens
    table = []

    def row(what, xla, walk, bound, src, note="", flops=None):
        table.append((what, xla, walk, bound, src, note, flops))
        x = "-" if xla is None else f"{xla / 2**20:,.1f}"
        print(f"  [{time.strftime('%H:%M:%S')}] {what}: XLA {x} MiB, walk {walk / 2**20:,.1f} MiB "
              f"({walk / bound:.2f}x bound) {note}", flush=True)

    def pair(compile_one):
        one, shape = compile_one(1)
        c1, c2 = cost(one), cost(compile_one(2)[0])
        return c1, scaled(c1, c2, L), one, shape

    print(f"Qwen3-4B {args.dtype}, {args.rows} rows = {n_prompts} prompts x {SAMPLES}, prompts {LO:,}-{HI:,} "
          f"(mean {prompt_tokens / n_prompts:,.0f}), {NEW} new; engine pages of {PAGE}, "
          f"{shapes.pages_per_slot} per slot, kernel blocks of {BLOCK_K[0]} keys; scaled to {L} layers; "
          f"bound per token: decode {dec_bound / 2**20:,.2f} MiB, prefill {pre_bound / 2**20:,.2f} MiB", flush=True)
    # --- decode: bytes per generated token (one step / rows) ----------------------------------
    if not args.skip_static:
        (one, gen1), (two, gen2) = (static_compile(cfg, mesh, n_prompts, k, "decode") for k in (1, 2))
        c1 = cost(one)
        s = scaled(c1, cost(two), L)
        # Unrolled, the layers copy the generated cache each step (the attention's read of a
        # layer is not ordered before the step's in-place write); the layer scan the sampler runs
        # orders them, and has no copy. Those bytes are the cost model's, not the sampler's.
        scanned, _ = static_compile(cfg, mesh, n_prompts, 2, "decode", layer_unroll=1)
        n_unrolled, n_scanned = shape_copies(two, gen2, hlo_dt), shape_copies(scanned, gen2, hlo_dt)
        w1, w2 = copies_walk(one, gen1, hlo_dt), copies_walk(two, gen2, hlo_dt)
        copied = (w1 + (L - 1) * (w2 - w1)) if n_unrolled and not n_scanned else 0.0
        row("static decode", per(s["bytes"], args.rows), (s["walk"] - copied) / args.rows, dec_bound, "compiler",
            f"cache aliased {c1['alias'] / 2**20:,.0f} MiB (1 layer); generated-cache copies per step: "
            f"{n_scanned} in the layer scan it runs" + (f" (the unrolled compile's {n_unrolled}, "
                                                        f"{copied / args.rows / 2**20:,.1f} MiB/token, left out of the walk)"
                                                        if copied else ""), per(s["flops"], args.rows))
    c1, s, one, pool_shape = pair(lambda k: engine_compile(cfg, mesh, shapes, "gather", k, "segment"))
    pool_bytes = 2 * math.prod(pool_shape) * item
    row("engine decode, attention=gather (whole table)", per(s["bytes"], args.rows), s["walk"] / args.rows, dec_bound,
        "compiler", f"pool aliased {c1['alias'] / 2**20:,.0f} of {pool_bytes / 2**20:,.0f} MiB (1 layer); "
        f"pool copies {shape_copies(one, pool_shape, hlo_dt)}", per(s["flops"], args.rows))
    # everything but the attention, compiled without it; plus what the kernel reads (kernel model)
    _, s, _, _ = pair(lambda k: engine_compile(cfg, mesh, shapes, "gather", k, "segment", without_attention=True))
    outside = s["walk"]
    row("engine decode, outside attention (attention left out)", None, outside / args.rows, dec_bound,
        "compiler", f"weights {weights / args.rows / 2**20:,.1f} MiB/token of it; the rest activations, "
        "the LM head's logits and the token chooser")
    kvh, dh = cfg.num_key_value_heads, cfg.head_dim
    kernel = outside + kernel_decode_bytes(live_rows, kv_tl, L) + parts_bytes(args.rows, kvh, dh, L)
    row("engine decode, attention=paged_gpu, no prompt sharing (before)", None, kernel / args.rows, dec_bound,
        "compiler + kernel model", "4 samples read their prompt's pages 4 times")
    parts = parts_bytes(args.rows + n_prompts, kvh, dh, L)             # the own pass's rows, the shared one's blocks
    shared = outside + kernel_shared_decode_bytes(prompts, mid_gen, kv_tl, L) + parts
    row("engine decode, attention=paged_gpu, prompts shared", None, shared / args.rows, dec_bound,
        "compiler + kernel model", "a prompt's whole pages once for its 4 samples (engine/prompt_sharing.py); "
        f"the kernels' partial results {parts / args.rows / 2**20:,.1f} MiB/token of it")
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    parts = (parts_bytes(args.rows, kvh, dh, L, queries=group)                # a row's own pass: its G heads
             + parts_bytes(n_prompts, kvh, dh, L, queries=group * SAMPLES))  # a block: G heads x 4 samples
    masked = outside + kernel_shared_decode_bytes(prompts, mid_gen, kv_tl, L, granule=1) + parts
    row("engine decode, paged_gpu, prompts shared, live keys loaded, real queries stored (after)", None,
        masked / args.rows, dec_bound, "compiler + kernel model",
        "masked loads: no key at or past a row's length (the reply's pages held ahead, the last page's tail); "
        f"masked stores: a decode row's {group} heads of its 16-query block; partial results "
        f"{parts / args.rows / 2**20:,.1f} MiB/token")
    # --- prefill: bytes per prompt token --------------------------------------------------------
    if not args.skip_static:
        c1, s, one, _ = pair(lambda k: static_compile(cfg, mesh, n_prompts, k, "prefill"))
        row("static prefill (one call, padded to 4,096)", per(s["bytes"], prompt_tokens), s["walk"] / prompt_tokens,
            pre_bound, "compiler", f"temp {c1['temp'] / 2**30:,.2f} GiB (1 layer)", per(s["flops"], prompt_tokens))
    c1, s, one, pool_shape = pair(lambda k: engine_compile(cfg, mesh, shapes, "gather", k, "chunk"))
    row("engine prefill, attention=gather", per(s["bytes"], prompt_tokens / calls), s["walk"] * calls / prompt_tokens,
        pre_bound, "compiler", f"{calls} calls; temp {c1['temp'] / 2**30:,.2f} GiB (1 layer); pool aliased "
        f"{c1['alias'] / 2**20:,.0f} MiB, pool copies {shape_copies(one, pool_shape, hlo_dt)}",
        per(s["flops"], prompt_tokens / calls))
    c1, s, one, pool_shape = pair(lambda k: engine_compile(cfg, mesh, shapes, "live", k, "chunk"))
    block = block_bytes(cfg, mesh, shapes.pages_per_slot, args.dtype)   # one block + the merge, walked
    blocks = live_blocks(prompts)
    _, s, _, _ = pair(lambda k: engine_compile(cfg, mesh, shapes, "gather", k, "chunk", without_attention=True))
    rest = s["walk"] * calls                                            # the chunk calls less their attention
    row("engine prefill, attention=live", None, (rest + L * blocks * block) / prompt_tokens, pre_bound,
        "compiler x blocks", f"{blocks / calls:.1f} blocks of {BLOCK_TOKENS} keys per call (a loop body is "
        f"counted once); temp {c1['temp'] / 2**30:,.2f} GiB (1 layer); pool copies "
        f"{shape_copies(one, pool_shape, hlo_dt)}")
    row("engine prefill, attention=paged_gpu, chunk 512 (before: one kernel row per prompt token)", None,
        (rest + kernel_prefill_bytes(prompts, kv_tl, L)) / prompt_tokens, pre_bound, "compiler + kernel model")
    # after (programs.FRESH_PREFILL): calls whose lanes all start a prompt run the model's causal
    # attention ("xla" here, as the static row; cuDNN on a GPU for both)
    c1, s, one, pool_shape = pair(lambda k: engine_compile(cfg, mesh, shapes, "paged_gpu", k, "chunk", fresh=True))
    first = math.ceil(n_prompts / LANES)                                # calls of first chunks, all fresh
    later = (rest / calls) * (calls - first) + kernel_prefill_bytes(prompts, kv_tl, L, after=CHUNK)
    row("engine prefill, paged_gpu, chunk 512, fresh first chunks, later ones a kernel row a token", None,
        (s["walk"] * first + later) / prompt_tokens, pre_bound, "compiler + kernel model",
        f"{first} fresh calls; pool copies {shape_copies(one, pool_shape, hlo_dt)}")
    later = (rest / calls) * (calls - first) + kernel_prefill_block_bytes(prompts, group, kv_tl, L, after=CHUNK)
    row("engine prefill, paged_gpu, chunk 512, fresh first chunks, later ones in query blocks (after)", None,
        (s["walk"] * first + later) / prompt_tokens, pre_bound, "compiler + kernel model",
        f"blocks of {QUERY_BLOCK // group} tokens x {group} heads (paged_gpu_parts.py)")
    whole = EngineConfig(slots=args.rows, page_size=PAGE, max_len=HI + NEW, chunk=HI, segment=16)
    c1, s, one, pool_shape = pair(lambda k: engine_compile(cfg, mesh, whole, "paged_gpu", k, "chunk", fresh=True))
    row(f"engine prefill, paged_gpu, chunk {HI:,}: every call fresh (after)", per(s["bytes"], prompt_tokens / first),
        s["walk"] * first / prompt_tokens, pre_bound, "compiler",
        f"{first} calls; temp {c1['temp'] / 2**30:,.2f} GiB (1 layer, xla scores); pool aliased "
        f"{c1['alias'] / 2**20:,.0f} MiB, pool copies {shape_copies(one, pool_shape, hlo_dt)}",
        per(s["flops"], prompt_tokens / first))
    print("\nAll figures are estimates from the CPU compile (XLA: HloCostAnalysis 'bytes accessed'; walk: "
          "benchmarks/hlo_bytes.py over the optimized HLO, in-place updates and indexed reads at what they touch) "
          "or the paged kernel's loop bounds (kernel model); none is a device timing.\n")
    print("| program | XLA bytes accessed, MiB/token | walk, MiB/token | walk / bound | XLA GFLOP/token | source "
          "| notes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for what, xla, walk, bound, src, note, flops in table:
        x = "-" if xla is None else f"{xla / 2**20:,.1f}"
        f = "-" if flops is None else f"{flops / 1e9:,.1f}"
        print(f"| {what} | {x} | {walk / 2**20:,.2f} | {walk / bound:.2f} | {f} | {src} | {note} |")


def block_bytes(cfg, mesh, pps: int, dtype: str) -> float:
    """Bytes of one 128-key block of the live path for a chunk call, by the compiler: the live
    attention alone on one layer's pool at the chunk's shapes, whose loop body (one block) XLA
    counts once, plus the merge (so an upper bound per block)."""
    from actionopd_jax.model.attention.paged_live import paged_attention_live

    kvh, dh, hq = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    sds = jax.ShapeDtypeStruct
    pages = sds((kvh, LANES * pps + 1, PAGE, dh), dtype)
    with set_mesh(mesh):
        compiled = jax.jit(paged_attention_live).lower(
            sds((LANES, CHUNK, hq, dh), dtype), pages, pages, sds((LANES,), jnp.int32),
            sds((LANES, pps), jnp.int32), q_positions=sds((LANES, CHUNK), jnp.int32)).compile()
    return cost(compiled)["walk"]


if __name__ == "__main__":
    main()
