"""The sampler's decode program compiled ahead of time for a TPU topology on this CPU host.

Prints one table: compile time of the decode program for the full depth against a 2-layer
copy of the model (the layer scan keeps it flat), per-chip memory of the full-depth program
against HBM, and a per-decode-step estimate from the compiler's cost model beside the
memory-bandwidth bound.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/sampler_aot.py --preset qwen3-4b \\
        --prompts 16 --samples 4 --prompt-len 4096 --max-new 4096 --mesh tensor=4

Long prompts (prefill through Qwen3.prefill_kv, splash on TPU) and the token budget:

    python benchmarks/sampler_aot.py --prefill --prompt-len 24576 --skip-cost
    python benchmarks/sampler_aot.py --prompts 64 --budget-from-hbm            # 64 states, 4,096-token prompts
    python benchmarks/sampler_aot.py --prompts 64 --prompt-len 24576 --budget-from-hbm

--budget-from-hbm plans the Sampler's split of the --prompts states (sampling/budget.py:
HBM minus the parameters' shards, x SAFETY, over bytes per cached token) and compiles
prefill + decode of each distinct part, printing the planned peak beside the compiled one.

Cost model caveat: XLA's cost analysis counts a loop body once. The decode program's
`while_loop` body is one step, but its layer `scan` body is one layer; so the per-step
estimate comes from two extra compiles with the layers unrolled (no layer loop), at 2 and
4 layers: per layer = (cost(4) - cost(2)) / 2, the rest of the step (embedding, LM head,
token choice) = cost(2) - 2 * per layer, step = rest + L * per layer. (A 1-layer program
is not used: its fusion choices differ; measured, its bytes exceeded the 2-layer one's.)
The rest includes the token choice's `lax.cond` branches as if taken (the rare exact
full-vocabulary path: ~25 passes over the logits), so it is an upper bound.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the host compiles; the target is the topology

from actionopd_jax.model.config import PRESETS, count_params  # noqa: E402
from actionopd_jax.model.runtime import RuntimeOptions  # noqa: E402
from actionopd_jax.sampling import aot  # noqa: E402


def _cost(compiled) -> dict:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return {k: float(c.get(k, 0.0)) for k in ("flops", "bytes accessed", "optimal_seconds")}


def _param_bytes_per_chip(cfg, mesh) -> int:
    """Bytes of the parameters on the fullest chip (their shards under the model's shardings)."""
    import jax
    import numpy as np

    _, params = aot.abstract_model(cfg, mesh)
    total = 0
    for x in jax.tree.leaves(params):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total


def _budgeted(cfg, mesh, args) -> None:
    """The Sampler's token-budget split of one collector-sized call, each part compiled."""
    from actionopd_jax.sampling import Buckets, budget

    hbm = args.hbm_gib * aot.GIB
    params = _param_bytes_per_chip(cfg, mesh)
    tokens = budget.token_budget(cfg, hbm - params, mesh.size, dtype=args.dtype)
    b = Buckets()
    chunks = budget.plan_chunks([args.samples] * args.prompts, [args.prompt_len] * args.prompts,
                                [args.max_new] * args.prompts, b, tokens)
    print(f"params per chip {params / aot.GIB:.2f} GiB; {budget.describe(cfg, tokens)} "
          f"(safety {budget.SAFETY}, prefill factor {budget.PREFILL_FACTOR}); "
          f"{args.prompts} states -> parts of {[len(c) for c in chunks]}")
    unplanned = budget.chunk_tokens(Buckets.fit(args.prompts, b.prompts, "prompts"),
                                    Buckets.fit(args.prompt_len, b.prompt_len, "prompt_len"), args.samples,
                                    Buckets.fit(args.max_new, b.max_new, "max_new"))
    print(f"whole call: {unplanned:.0f} cache-token equivalents vs budget {tokens}")
    for size in sorted({len(c) for c in chunks}, reverse=True):
        rows = Buckets.fit(size, b.prompts, "prompts")
        plen = Buckets.fit(args.prompt_len, b.prompt_len, "prompt_len")
        new = Buckets.fit(args.max_new, b.max_new, "max_new")
        used = budget.chunk_tokens(rows, plen, args.samples, new)
        try:
            programs = aot.compile_sampler_programs(cfg, mesh, prompts=rows, prompt_len=plen, samples=args.samples,
                                                    max_new=new, runtime=RuntimeOptions(dtype=args.dtype))
        except Exception as e:  # noqa: BLE001 - the compiler's verdict is the result
            print(f"part of {size} states ({rows} x {plen}): {str(e).strip().splitlines()[0][:200]}")
            continue
        pre, dec = aot.memory_gib(programs.prefill), aot.memory_gib(programs.decode)
        planned = (params + used * budget.cache_bytes_per_token(cfg, args.dtype) / mesh.size) / aot.GIB
        print(f"  planned peak (params + budget tokens) {planned:.2f} GiB vs compiled prefill peak {pre['peak']:.2f}")
        print(f"part of {size} states ({rows} prompts x {plen}, {args.samples} x {new} new; {used:.0f} of {tokens} "
              f"budget tokens): prefill peak {pre['peak']:.2f} GiB ({100 * (1 - pre['peak'] / args.hbm_gib):.0f}% "
              f"free; temp {pre['temp']:.2f}), decode peak {dec['peak']:.2f} GiB "
              f"({100 * (1 - dec['peak'] / args.hbm_gib):.0f}% free); compile {programs.prefill_seconds:.0f} s + "
              f"{programs.decode_seconds:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-4b")
    ap.add_argument("--dtype", default="bfloat16", help="param and compute dtype")
    ap.add_argument("--topology", default="v5p:2x2x1")
    ap.add_argument("--mesh", default="tensor=4", help="comma-separated axis=size over the topology's chips")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--max-new", type=int, default=4096)
    ap.add_argument("--small-layers", type=int, default=2, help="depth of the compile-time comparison")
    ap.add_argument("--hbm-gib", type=float, default=95.74, help="HBM per chip (v5p: 95.74 GiB)")
    ap.add_argument("--hbm-gbps", type=float, default=2765.0, help="HBM bandwidth per chip, GB/s (v5p: 2765)")
    ap.add_argument("--skip-cost", action="store_true", help="skip the two unrolled compiles of the cost estimate")
    ap.add_argument("--prefill", action="store_true",
                    help="also compile prefill (and decode from prefill's own output shardings)")
    ap.add_argument("--budget-from-hbm", action="store_true",
                    help="split the --prompts states into the Sampler's token-budgeted calls (budget from HBM "
                         "minus parameters, sampling/budget.py) and compile prefill + decode of each distinct part")
    args = ap.parse_args()

    cfg = PRESETS[args.preset].replace(param_dtype=args.dtype)
    runtime = RuntimeOptions(dtype=args.dtype)
    topo = aot.v5p_topology(args.topology)
    mesh = aot.tpu_mesh(topo, {k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))})
    chips = mesh.size
    shape = dict(prompts=args.prompts, prompt_len=args.prompt_len, samples=args.samples, max_new=args.max_new)
    rows = args.prompts * args.samples
    L = cfg.num_hidden_layers
    print(f"# {args.preset} ({args.dtype}) decode on {args.topology} mesh {dict(mesh.shape)}: "
          f"{args.prompts} prompts x {args.samples} samples = {rows} rows, prompt cache {args.prompt_len}, "
          f"{args.max_new} new tokens")

    table: list[tuple[str, str]] = []
    if args.budget_from_hbm:
        _budgeted(cfg, mesh, args)
        return
    step = None
    if not args.skip_cost:
        two, _ = aot.compile_decode(cfg.replace(num_hidden_layers=2), mesh, **shape, layer_unroll=2, runtime=runtime)
        four, _ = aot.compile_decode(cfg.replace(num_hidden_layers=4), mesh, **shape, layer_unroll=4, runtime=runtime)
        c2, c4 = _cost(two), _cost(four)
        per_layer = {k: (c4[k] - c2[k]) / 2 for k in c2}
        rest = {k: c2[k] - 2 * per_layer[k] for k in c2}
        step = {k: rest[k] + L * per_layer[k] for k in c2}

    small, small_s = aot.compile_decode(cfg.replace(num_hidden_layers=args.small_layers), mesh, **shape, runtime=runtime)
    full, full_s = aot.compile_decode(cfg, mesh, **shape)
    table.append((f"decode compile, {L} layers (s)", f"{full_s:.1f}"))
    table.append((f"decode compile, {args.small_layers} layers (s)", f"{small_s:.1f}"))
    table.append((f"ratio {L} / {args.small_layers} layers", f"{full_s / small_s:.2f}"))
    if args.prefill:
        try:
            programs = aot.compile_sampler_programs(cfg, mesh, **shape)
        except Exception as e:  # noqa: BLE001 - the compiler's verdict (e.g. out of HBM) is the result
            programs = None
            table.append(("prefill", str(e).strip().splitlines()[0][:160]))
    if args.prefill and programs is not None:
        pre = aot.memory_gib(programs.prefill)
        table.append(("prefill compile (s)", f"{programs.prefill_seconds:.1f}"))
        table.append(("prefill memory per chip: args / out / temp (GiB)",
                      f"{pre['args']:.2f} / {pre['out']:.2f} / {pre['temp']:.2f}"))
        table.append(("prefill memory per chip: peak (GiB)", f"{pre['peak']:.2f} of {args.hbm_gib} "
                                                             f"({100 * (1 - pre['peak'] / args.hbm_gib):.0f}% free)"))
        table.append(("decode after prefill: peak per chip (GiB)", f"{aot.memory_gib(programs.decode)['peak']:.2f}"))
    mem = aot.memory_gib(full)
    for k in ("args", "out", "temp", "alias"):
        table.append((f"memory per chip: {k} (GiB)", f"{mem[k]:.2f}"))
    table.append(("memory per chip: peak (GiB)", f"{mem['peak']:.2f} of {args.hbm_gib} "
                                                 f"({100 * (1 - mem['peak'] / args.hbm_gib):.0f}% free)"))

    # memory-bandwidth bound of one step: every weight and every cache slot read once
    bytes_per = 2 if args.dtype == "bfloat16" else 4
    params = count_params(cfg)["total"]
    kv_slot = 2 * L * cfg.num_key_value_heads * cfg.head_dim * bytes_per          # k and v, all layers
    kv_prompt = args.prompts * args.prompt_len * kv_slot
    kv_gen = rows * args.max_new * kv_slot                                         # one phase: the whole buffer
    weights = params * bytes_per
    bound_s = (weights + kv_prompt + kv_gen) / chips / (args.hbm_gbps * 1e9)
    table.append(("step bytes per chip: weights / prompt KV / generated KV (GB)",
                  f"{weights / chips / 1e9:.2f} / {kv_prompt / chips / 1e9:.2f} / {kv_gen / chips / 1e9:.2f}"))
    table.append(("bandwidth bound per step (ms)", f"{1e3 * bound_s:.2f}"))
    table.append(("bandwidth bound tokens/s per chip", f"{rows / bound_s / chips:.0f}"))
    if step is not None:
        table.append(("cost model per step: TFLOP per chip", f"{step['flops'] / 1e12:.3f}"))
        table.append(("cost model per step: GB accessed per chip", f"{step['bytes accessed'] / 1e9:.2f}"))
        table.append(("cost model per step: optimal (ms)", f"{1e3 * step['optimal_seconds']:.2f}"))
        table.append(("  of which layers / rest (ms)", f"{1e3 * L * per_layer['optimal_seconds']:.2f} / "
                                                      f"{1e3 * rest['optimal_seconds']:.2f}"))
        table.append(("  GB per layer: cost model / weights+KV", f"{per_layer['bytes accessed'] / 1e9:.3f} / "
                      f"{(count_params(cfg)['per_layer'] * bytes_per + (kv_prompt + kv_gen) / L) / chips / 1e9:.3f}"))
        table.append(("cost model tokens/s per chip", f"{rows / step['optimal_seconds'] / chips:.0f}"))
        table.append(("cost model / bandwidth bound (time)", f"{step['optimal_seconds'] / bound_s:.2f}"))
    flops_analytic = 2 * params * rows / chips   # matmul FLOPs of the weights alone, per chip
    table.append(("analytic weight FLOPs per step per chip (TFLOP)", f"{flops_analytic / 1e12:.3f}"))

    width = max(len(k) for k, _ in table)
    for k, v in table:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
