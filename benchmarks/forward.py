"""Forward benchmark of the Flax Qwen3: compile time vs depth and tokens/s (random weights).

    python benchmarks/forward.py                      # default: CPU-sized run, a few minutes
    python benchmarks/forward.py --shapes tiny --layers 2 8

Compile time is measured on abstract inputs (no weights needed) with the persistent compile
cache off, for a full forward (hidden states + last-position logits) and for a KV-cache
decode step.  Throughput uses randomly initialised weights.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from actionopd_jax.model import PRESETS, KVCache, Qwen3, RuntimeOptions, count_params, flops_per_token, init_model


def _prefill_fn(graphdef):
    def fwd(state, tokens, positions):
        model = nnx.merge(graphdef, state)
        h, _ = model(tokens, positions)
        return model.logits(h[:, -1])
    return jax.jit(fwd)


def _decode_fn(graphdef):
    def step(state, tokens, positions, cache):
        model = nnx.merge(graphdef, state)
        h, cache = model(tokens, positions, cache=cache)
        return model.logits(h[:, -1]), cache
    return jax.jit(step, donate_argnums=(3,))


def compile_seconds(cfg, batch, seq, runtime=None) -> dict[str, float]:
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, runtime=runtime, rngs=nnx.Rngs(params=jax.random.key(0))))
    graphdef, state = nnx.split(abstract)
    tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    t0 = time.perf_counter()
    _prefill_fn(graphdef).lower(state, tok, tok).compile()
    t1 = time.perf_counter()
    cache = jax.eval_shape(lambda: KVCache.init(cfg, batch, seq + 64, runtime and runtime.dtype))
    one = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    _decode_fn(graphdef).lower(state, one, one, cache).compile()
    t2 = time.perf_counter()
    return {"forward": t1 - t0, "decode": t2 - t1}


def throughput(cfg, batch, seq, decode_steps, reps, key, runtime=None) -> dict[str, float]:
    model = init_model(cfg, key, runtime=runtime)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    prefill = _prefill_fn(graphdef)
    prefill(state, tokens, positions).block_until_ready()  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        prefill(state, tokens, positions).block_until_ready()
        times.append(time.perf_counter() - t0)
    fwd_s = float(np.median(times))

    decode = _decode_fn(graphdef)
    cache = KVCache.init(cfg, batch, seq + decode_steps + 1, model.runtime.dtype)
    # fill the cache with the prompt via the cached path (prefill of the whole prompt)
    h, cache = jax.jit(lambda s, t, p, c: nnx.merge(graphdef, s)(t, p, cache=c))(state, tokens, positions, cache)
    tok = tokens[:, -1:]
    pos = positions[:, -1:] + 1
    logits, cache = decode(state, tok, pos, cache)  # compile
    logits.block_until_ready()
    t0 = time.perf_counter()
    for i in range(decode_steps):
        logits, cache = decode(state, tok, pos + 1 + i, cache)
    logits.block_until_ready()
    dec_s = (time.perf_counter() - t0) / decode_steps
    fwd_flops = flops_per_token(cfg, seq // 2, with_lm_head=False) * batch * seq
    return {"forward_tok_s": batch * seq / fwd_s, "forward_s": fwd_s,
            "forward_gflop_s": fwd_flops / fwd_s / 1e9,
            "decode_tok_s": batch / dec_s, "decode_step_ms": dec_s * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["tiny", "qwen3-0.6b"], choices=sorted(PRESETS))
    ap.add_argument("--layers", nargs="+", type=int, default=[2, 8, 32])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print one JSON line with all numbers")
    args = ap.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)

    results = {"devices": str(jax.devices()), "compile": [], "throughput": []}
    print(f"devices: {jax.devices()}  batch={args.batch} seq={args.seq} dtype={args.dtype}")
    print("\ncompile time vs depth (seconds; full forward / one decode step)")
    print(f"{'shape':<12}" + "".join(f"{f'L={n}':>18}" for n in args.layers))
    for name in args.shapes:
        cfg = PRESETS[name].replace(param_dtype=args.dtype)
        row = []
        for n in args.layers:
            c = compile_seconds(cfg.replace(num_hidden_layers=n), args.batch, args.seq, RuntimeOptions(dtype=args.dtype))
            row.append(f"{c['forward']:.2f} / {c['decode']:.2f}")
            results["compile"].append({"shape": name, "layers": n, **c})
        print(f"{name:<12}" + "".join(f"{r:>18}" for r in row))

    print("\nthroughput (preset depth, random weights)")
    print(f"{'shape':<12}{'params':>10}{'fwd tok/s':>12}{'fwd GFLOP/s':>13}{'decode tok/s':>14}{'step ms':>10}")
    key = jax.random.key(args.seed)
    for name in args.shapes:
        cfg = PRESETS[name].replace(param_dtype=args.dtype)
        r = throughput(cfg, args.batch, args.seq, args.decode_steps, args.reps, key, RuntimeOptions(dtype=args.dtype))
        results["throughput"].append({"shape": name, **r})
        print(f"{name:<12}{count_params(cfg)['total'] / 1e6:>9.1f}M{r['forward_tok_s']:>12.0f}"
              f"{r['forward_gflop_s']:>13.1f}{r['decode_tok_s']:>14.1f}{r['decode_step_ms']:>10.1f}")
    if args.json:
        print("FORWARD_BENCH_JSON " + json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
