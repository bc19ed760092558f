"""Sampler speed on the fixed peer_bench workload, next to the peers, in one run.

    python benchmarks/sampler.py --config bench-tiny [--reps 3] [--skip-peers] --peer-bench DIR
                                 [--lm-head checked,float32,bfloat16] [--hf-python PY] [--tunix-python PY]

Workload (common.py of the peer harness named by --peer-bench): 8 prompts x 512 ids, 4 samples each, exactly 128
new tokens (no end token), T=0.6, top-k 20, top-p 0.95, on the shared checkpoint written by
the harness's hf_bench.py (our logits are checked against its ref_logits.npy first). Then the
peers (transformers and Tunix, with the interpreters --hf-python and --tunix-python name) run the same
workload in subprocesses, one at a time, and a table with ratios is printed. Last, a
mixed-length workload reports how many programs the bucketing compiles, and how long that takes.
`--lm-head` lists the Sampler(lm_head=...) modes to time, each a labelled row; the first
(default: "checked", the Sampler's default) gives the ratios and the JSON `sample`. Modes run
with the same keys, so the table also reports how far their logprobs are from the first's.
Last stdout line: `ANCHOR_BENCH_JSON {...}` (our numbers and the ratios).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers import PEER_OPTIONS, add_peer_args, peer_pythons  # noqa: E402

PEERS = {  # name -> script in the peer harness (interpreters: --hf-python, --tunix-python)
    "transformers": "hf_bench.py",
    "tunix": "tunix_bench.py",
}


def _common(peer_dir: Path):
    spec = importlib.util.spec_from_file_location("peer_bench_common", peer_dir / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_peer(name: str, python: str | None, peer_dir: Path, config: str, workload: str, reps: int) -> dict | None:
    script = PEERS[name]
    if python is None:
        print(f"[{name}] skipped: no {PEER_OPTIONS[name][0]} given", flush=True)
        return None
    cmd = [python, str(peer_dir / script), "--config", config, "--workload", workload, "--reps", str(reps)]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=peer_dir)
    for line in proc.stdout.splitlines():
        if line.startswith("ANCHOR_BENCH_JSON "):
            return json.loads(line[len("ANCHOR_BENCH_JSON "):])
    print(f"[{name}] failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}", flush=True)
    return None


def check_weights(model, C, model_dir: Path) -> float:
    """Max |our logits - transformers' logits| on the harness's reference input."""
    import jax.numpy as jnp
    from flax import nnx

    @nnx.jit
    def logits(model, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        hidden, _ = model(tokens, positions)
        return model.logits(hidden)

    ref = np.load(model_dir / "ref_logits.npy")
    ours = np.asarray(logits(model, jnp.asarray(C.ref_input())))
    return float(np.max(np.abs(ours - ref)))


def bench_ours(model, C, reps: int, lm_head: str = "checked") -> tuple[dict, Any]:
    """(summary of `reps` timed calls, the last call's SampleResult)."""
    import jax

    from actionopd_jax.sampling import Sampler

    sampler = Sampler(model, eos_ids=[], lm_head=lm_head)  # no end token: exactly NEW_TOKENS per row
    label = f"ours (lm_head={lm_head})"
    fallbacks = []
    prompts = list(C.prompts())
    kw = dict(n=C.N_SAMPLES, max_new_tokens=C.NEW_TOKENS, temperature=C.TEMPERATURE, top_k=C.TOP_K, top_p=C.TOP_P)

    def one(seed):
        t0 = time.perf_counter()
        out = sampler.sample(prompts, key=jax.random.key(seed), **kw)
        total = time.perf_counter() - t0
        assert all(len(g.token_ids) == C.NEW_TOKENS for gens in out.generations for g in gens)
        fallbacks.append(out.head_fallback_steps)
        return dict(prefill_s=out.prefill_s, decode_s=total - out.prefill_s, total_s=total), out

    t = time.perf_counter()
    one(100)
    warm = time.perf_counter() - t
    runs = []
    for i in range(reps):
        r, out = one(101 + i)
        runs.append(r)
        print(label, "sample rep", i, {k: round(v, 4) for k, v in r.items()}, flush=True)
    res = C.sampling_summary(runs, warm)
    res["distinct_rows"] = len({tuple(g.token_ids.tolist()) for gens in out.generations for g in gens})
    res["compiled_programs"] = sampler.stats.programs
    res["compile_s"] = round(sampler.stats.seconds, 2)
    res["lm_head"] = lm_head
    res["head_fallback_steps"] = fallbacks[1:]  # per timed call
    res["decode_steps_per_call"] = C.NEW_TOKENS - 1
    return res, out


def bench_compiles(model, buckets=None, seed: int = 0, calls: int = 12) -> dict:
    """A collector-like stream of calls: 1-8 ready states of ragged prompt length (20-900
    tokens), N=4 samples, a fixed reply budget, sampling settings changing from call to call.
    Reports the programs compiled and the time spent compiling them."""
    import jax

    from actionopd_jax.sampling import Sampler

    rng = np.random.default_rng(seed)
    sampler = Sampler(model, eos_ids=[151645], buckets=buckets)
    t0 = time.perf_counter()
    for i in range(calls):
        n_prompts = int(rng.integers(1, 9))
        prompts = [rng.integers(0, 151643, int(rng.integers(20, 900))).astype(np.int32) for _ in range(n_prompts)]
        sampler.sample(prompts, n=4, max_new_tokens=48, temperature=float(rng.choice([0.0, 0.6, 1.0])),
                       top_k=int(rng.choice([0, 20])), top_p=float(rng.choice([0.95, 1.0])), key=jax.random.key(i))
    return dict(calls=calls, compiled_programs=sampler.stats.programs,
                compile_s=round(sampler.stats.seconds, 2), total_s=round(time.perf_counter() - t0, 2),
                programs=[list(map(str, s)) for s in sampler.stats.shapes])


def _table(config: str, ours: dict, peers: dict[str, dict], extra: dict[str, dict]) -> str:
    """ours: the default sampler (the ratios); extra: other lm_head modes, by name."""
    compared = [(f"ours ({ours['lm_head']})", ours)] + [(f"ours ({name})", r) for name, r in extra.items()]
    rows = compared + [(name, r["sample"]) for name, r in peers.items()]
    lines = [f"\n{config}: 8 prompts x 512, 4 samples, 128 new tokens (medians)",
             f"{'system':<22}{'prefill s':>11}{'decode tok/s':>14}{'total s':>10}{'e2e tok/s':>11}",
             ]
    for name, r in rows:
        lines.append(f"{name:<22}{r['prefill_s']:>11.3f}{r['decode_tok_per_s']:>14.1f}{r['total_s']:>10.2f}"
                     f"{r['e2e_gen_tok_per_s']:>11.1f}")
    for label, mine in compared:
        for name, r in peers.items():
            p = r["sample"]
            lines.append(f"{label} vs {name}: decode x{mine['decode_tok_per_s'] / p['decode_tok_per_s']:.2f}, "
                         f"prefill x{p['prefill_s'] / mine['prefill_s']:.2f} faster, "
                         f"end-to-end x{mine['e2e_gen_tok_per_s'] / p['e2e_gen_tok_per_s']:.2f}")
    for name, r in extra.items():
        v = r["vs_first"]
        lines.append(f"ours ({name}) vs ours ({ours['lm_head']}), same keys: {v['same_tokens']:.0%} of rows with "
                     f"identical tokens, max |logprob difference| {v['max_logprob_diff']:.2e}")
    for name, r in compared:
        if r["lm_head"] == "checked":
            lines.append(f"{name}: decode steps that fell back to the float32 head, per call: "
                         f"{r['head_fallback_steps']} of {r['decode_steps_per_call']}")
    if "bfloat16" in extra or ours["lm_head"] == "bfloat16":
        lines.append("bfloat16: opt-in head rounded to bfloat16 (float32 accumulation); its samples and "
                     "logprobs are the rounded head's, not the float32 model's.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="bench-tiny", choices=["bench-tiny", "bench-small"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--skip-compile-workload", action="store_true")
    ap.add_argument("--lm-head", default="checked,float32",
                    help="comma-separated Sampler lm_head modes to time (checked, float32, bfloat16); the "
                         "first is the one the ratios use (default: checked, the Sampler's default)")
    ap.add_argument("--peer-bench", required=True, metavar="DIR",
                    help="the peer benchmark harness (its common.py defines the workload, hf_bench.py writes "
                         "the shared checkpoint); it is not part of this repository")
    add_peer_args(ap)
    a = ap.parse_args(argv)
    pythons = peer_pythons(a)
    peer_dir = Path(a.peer_bench)
    if not (peer_dir / "common.py").is_file():
        print(f"--peer-bench {peer_dir}: no common.py there; name the peer harness directory "
              "(its common.py defines the workload, hf_bench.py writes the shared checkpoint)", file=sys.stderr)
        return 2
    C = _common(peer_dir)
    model_dir = Path(C.model_dir(a.config))
    if not (model_dir / "ref_logits.npy").exists():
        print(f"{model_dir} missing: writing it with hf_bench.py", flush=True)
        if _run_peer("transformers", pythons["transformers"], peer_dir, a.config, "prepare", 0) is None:
            print(f"cannot create {model_dir}; run hf_bench.py of the harness with --config {a.config} first (or pass --hf-python)", file=sys.stderr)
            return 2

    import jax

    from actionopd_jax.model.weights import load_hf

    t = time.perf_counter()
    cfg, model = load_hf(model_dir)
    load_s = time.perf_counter() - t
    diff = check_weights(model, C, model_dir)
    print(f"loaded {model_dir} in {load_s:.2f} s; max |logits - ref_logits| = {diff:.2e}", flush=True)
    if diff > 1e-3:
        print("our logits do not match the harness's reference: not benchmarking", file=sys.stderr)
        return 1
    modes = [m.strip() for m in a.lm_head.split(",") if m.strip()]
    ours, first = bench_ours(model, C, a.reps, modes[0])
    extra = {}
    for m in modes[1:]:
        extra[m], other = bench_ours(model, C, a.reps, m)
        # the same seeds: same tokens expected from checked vs float32, logprobs close
        pairs = [(g1, g2) for gs1, gs2 in zip(first.generations, other.generations) for g1, g2 in zip(gs1, gs2)]
        extra[m]["vs_first"] = dict(
            same_tokens=float(np.mean([np.array_equal(g1.token_ids, g2.token_ids) for g1, g2 in pairs])),
            max_logprob_diff=float(max(np.abs(g1.logprobs - g2.logprobs).max() for g1, g2 in pairs)))
    peers = {}
    if not a.skip_peers:
        for name in PEERS:
            r = _run_peer(name, pythons[name], peer_dir, a.config, "sample", a.reps)
            if r is not None and "sample" in r:
                peers[name] = r
    compiles = None
    if not a.skip_compile_workload:
        from actionopd_jax.sampling import Buckets
        compiles = {"default_buckets": bench_compiles(model),
                    # what a collector would configure: always pad to 8 states
                    "prompts_fixed_8": bench_compiles(model, Buckets(prompts=(8,)))}
    print(_table(a.config, ours, peers, extra))
    for name, c in (compiles or {}).items():
        print(f"mixed-length workload, {name}: {c['calls']} calls -> {c['compiled_programs']} compiled "
              f"programs, {c['compile_s']} s compiling (of {c['total_s']} s)")
    result = dict(system="actionopd_jax", config=a.config, jax=jax.__version__, load_s=round(load_s, 2),
                  max_logit_diff=diff, sample=ours, compile_workload=compiles, **C.machine(),
                  sample_other_lm_heads=extra,
                  peers={k: v["sample"] for k, v in peers.items()},
                  ratios={k: dict(decode=round(ours["decode_tok_per_s"] / v["sample"]["decode_tok_per_s"], 2),
                                  prefill_speedup=round(v["sample"]["prefill_s"] / ours["prefill_s"], 2),
                                  e2e=round(ours["e2e_gen_tok_per_s"] / v["sample"]["e2e_gen_tok_per_s"], 2))
                          for k, v in peers.items()})
    C.emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
