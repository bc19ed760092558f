"""The continuous-batching engine against the static sampler on CPU, same keys, same samples.

    python benchmarks/engine_cpu.py [--config bench-tiny] [--reps 3] [--segment 16]

Workloads (random bench-tiny weights; every run is warmed up first, so compile time is not in
the numbers; static and engine runs alternate; both paths use the default "checked" LM head):
- fixed: the sampler benchmark's shape (benchmarks/sampler.py): 8 prompts x 512 ids, 4 samples,
  exactly 128 new tokens (no end token), T=0.6, top-k 20, top-p 0.95;
- mixed: the same prompts, but each prompt's max_new_tokens drawn from 16..128 (long-tailed
  replies: rows that end early free their slot for the static call's whole remaining decode);
- turns: 4 trajectories x 3 states, each state = previous prompt + a 64-token reply + a 32-token
  tool result, one state per trajectory at a time (the collector's pattern), 4 x 64 new tokens;
- long: one 3,500-id prompt (an agent state's history), 4 samples x 32 new tokens: the static
  sampler prefills it padded to its 4,096 bucket, the engine in 256-token chunks over the live
  pages (an engine with max_len 3,584).
The engine runs through `Engine.sample`, so its segments run ahead (EngineConfig.run_ahead) while
nothing waits. Prints a table with seconds (best of the reps), tokens/s, the ratio of the bests and
the median and range of each rep's back-to-back ratio, and checks that the two paths gave the same
tokens.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from actionopd_jax.engine import Engine, EngineConfig
from actionopd_jax.model import PRESETS, Qwen3
from actionopd_jax.model.runtime import RuntimeOptions
from actionopd_jax.sampling import Sampler

SETTINGS = dict(temperature=0.6, top_k=20, top_p=0.95)


def _model(config: str):
    return Qwen3(PRESETS[config], runtime=RuntimeOptions(dtype="float32"), rngs=nnx.Rngs(params=0))


def _timed_pair(fn_a, fn_b, reps):
    """Best of `reps` for each, the two alternating (a, b, a, b, ...) so that a change in the
    machine's load mid-run falls on both (a shared VM: all of one then all of the other
    skewed the ratio by up to 20%); also each rep's b/a ratio (a and b timed back to back)."""
    out_a, out_b = fn_a(), fn_b()          # warm-up: compiles
    best, ratios = [1e9, 1e9], []
    for _ in range(reps):
        took = []
        for i, fn in enumerate((fn_a, fn_b)):
            t0 = time.perf_counter()
            out = fn()
            took.append(time.perf_counter() - t0)
            best[i] = min(best[i], took[-1])
            out_a, out_b = (out, out_b) if i == 0 else (out_a, out)
        ratios.append(took[1] / took[0])
    return best[0], out_a, best[1], out_b, ratios


def _same(a, b):
    """'all N' when every row is token-for-token equal, else 'k/N differ (first at step t)'."""
    pairs = [(x.token_ids, y.token_ids) for ga, gb in zip(a, b) for x, y in zip(ga, gb)]
    bad = [p for p in pairs if p[0].tolist() != p[1].tolist()]
    if not bad:
        return f"all {len(pairs)}"
    first = min(int(np.argmax(x[:min(x.size, y.size)] != y[:min(x.size, y.size)])) for x, y in bad)
    return f"{len(bad)}/{len(pairs)} differ (from step {first})"


def _turns(run_one, prompts, reps_key):
    """3 states per trajectory; run_one(list of prompts, keys) -> generations per prompt."""
    tool = np.arange(32, dtype=np.int32) + 7
    current = [p[:256] for p in prompts[:4]]
    out = []
    for turn in range(3):
        gens = run_one(current, [jax.random.key(1000 * turn + i) for i in range(len(current))])
        out.append(gens)
        current = [np.concatenate([c, g[0].token_ids, tool]) for c, g in zip(current, gens)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="bench-tiny", choices=["bench-tiny", "bench-small"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--segment", type=int, default=16)
    args = ap.parse_args()
    model = _model(args.config)
    rng = np.random.default_rng(0)
    vocab = PRESETS[args.config].vocab_size
    prompts = [rng.integers(0, vocab, size=512).astype(np.int32) for _ in range(8)]
    keys = [jax.random.key(i) for i in range(8)]
    mixed_new = [int(x) for x in rng.integers(16, 129, size=8)]
    never = [vocab + 1]                    # no end token: lengths are set by max_new_tokens
    sampler = Sampler(model, eos_ids=never)
    engine = Engine(model, eos_ids=never, config=EngineConfig(slots=32, page_size=16, max_len=640, chunk=256,
                                                              prefill_lanes=4, segment=args.segment))
    rows = []

    def both(name, static_fn, engine_fn, tokens, eng=engine):
        # every timed engine run starts with an empty prefix cache (reuse across reps would flatter it)
        s_t, s_out, e_t, e_out, ratios = _timed_pair(static_fn, lambda: (eng.invalidate(), engine_fn())[1],
                                                     args.reps)
        rows.append((name, s_t, e_t, tokens, _same(s_out, e_out), ratios))

    fixed = dict(n=4, max_new_tokens=128, **SETTINGS)
    both("fixed 8x512, 4x128", lambda: sampler.sample(prompts, key=keys, **fixed).generations,
         lambda: engine.sample(prompts, key=keys, **fixed).generations, 8 * 4 * 128)
    mixed = dict(n=4, max_new_tokens=mixed_new, **SETTINGS)
    both("mixed 8x512, 4x16..128", lambda: sampler.sample(prompts, key=keys, **mixed).generations,
         lambda: engine.sample(prompts, key=keys, **mixed).generations, 4 * sum(mixed_new))
    turn = dict(n=4, max_new_tokens=64, **SETTINGS)

    def static_turns():
        return [g for gens in _turns(lambda ps, ks: sampler.sample(ps, key=ks, **turn).generations, prompts, 0)
                for g in gens]

    def engine_turns():
        return [g for gens in _turns(lambda ps, ks: engine.sample(ps, key=ks, **turn).generations, prompts, 0)
                for g in gens]
    hits_before = engine.stats.prefix_hit_tokens
    both("turns 4 traj x 3 states", static_turns, engine_turns, 3 * 4 * 4 * 64)
    long_prompt = [rng.integers(0, vocab, size=3500).astype(np.int32)]
    long_engine = Engine(model, eos_ids=never, config=EngineConfig(slots=4, page_size=16, max_len=3584, chunk=256,
                                                                   prefill_lanes=1, segment=args.segment))
    longs = dict(n=4, max_new_tokens=32, **SETTINGS)
    both("long 1x3500, 4x32", lambda: sampler.sample(long_prompt, key=keys[:1], **longs).generations,
         lambda: long_engine.sample(long_prompt, key=keys[:1], **longs).generations, 4 * 32, eng=long_engine)
    print(f"engine prefix-cache hits over the runs: {engine.stats.prefix_hit_tokens - hits_before} tokens; "
          f"prefilled {engine.stats.prefilled_tokens}, compiled programs {engine.compile_count}")
    print(f"\n{args.config}, segment {args.segment}, best of {args.reps} (warm)")
    print(f"{'workload':26s} {'static s':>9s} {'engine s':>9s} {'static tok/s':>12s} {'engine tok/s':>12s} "
          f"{'engine/static time':>18s} {'per rep: median (range)':>24s}  same tokens")
    for name, s_t, e_t, tokens, same, ratios in rows:
        spread = f"{np.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"{name:26s} {s_t:9.2f} {e_t:9.2f} {tokens / s_t:12.0f} {tokens / e_t:12.0f} {e_t / s_t:18.2f} "
              f"{spread:>24s}  {same}")


if __name__ == "__main__":
    main()
