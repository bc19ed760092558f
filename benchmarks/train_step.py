"""Train-step speed on the fixed peer_bench workload, next to the peers, in one run.

    python benchmarks/train_step.py --config bench-tiny [--reps 3] [--skip-peers] --peer-bench DIR [--micro 8] [--hf-python PY] [--tunix-python PY]
        [--vocab-chunk 8192] [--scan-unroll 0] [--bf16-compute]

Workload (common.py of the peer harness named by --peer-bench): 32 rows of 512 prompt + 128 response ids, the
clipped-ratio loss on response tokens only (logits / 0.6, token mean, no KL), forward +
backward + AdamW(lr 1e-6); step_s = one update over all 32 rows. Ours is the project's
TrainStep (the dual-clip ActionOPD surrogate, which equals the plain clipped ratio here) on
one device, with the weights the harness's hf_bench.py wrote (logits checked against its
ref_logits.npy). Old log-probabilities are computed before the timed updates (the peers take
them as detach(new) inside the step), and that extra forward is reported separately.
The peers (transformers and Tunix, with the interpreters --hf-python and --tunix-python name) and the JAX
matmul peak run in subprocesses, one at a time. %-of-peak counts only the FLOPs the step
needs: causal attention, and the LM head at the 128 response positions only.
--vocab-chunk N (default 8192) scores response tokens with the fused LM head (online
log-sum-exp over N vocabulary rows at a time; 0: plain logits). --scan-unroll (default 0:
all layers; the config key model.scan_unroll) unrolls the layer scan. --bf16-compute also times
bfloat16 compute with float32 master weights (the peers run float32: that row is labelled and
not used for the headline ratios).
Last stdout line: `ANCHOR_BENCH_JSON {...}`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers import PEER_OPTIONS, add_peer_args, peer_pythons  # noqa: E402

PEERS = {  # name -> (script in the peer harness, extra args); interpreters: --hf-python, --tunix-python
    "transformers": ("hf_bench.py", []),
    "tunix": ("tunix_bench.py", ["--train-micro", "8"]),
}


def _common(peer_dir: Path):
    spec = importlib.util.spec_from_file_location("peer_bench_common", peer_dir / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(cmd: list[str], cwd: Path, label: str) -> dict | None:
    print(f"[{label}] {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    for line in proc.stdout.splitlines():
        if line.startswith("ANCHOR_BENCH_JSON "):
            return json.loads(line[len("ANCHOR_BENCH_JSON "):])
    print(f"[{label}] failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}", flush=True)
    return None


def run_peer(name: str, python: str | None, peer_dir: Path, config: str, reps: int) -> dict | None:
    script, extra = PEERS[name]
    if python is None:
        print(f"[{name}] skipped: no {PEER_OPTIONS[name][0]} given", flush=True)
        return None
    return _run([python, str(peer_dir / script), "--config", config, "--workload", "train", "--reps", str(reps),
                 *extra], peer_dir, name)


def needed_flops(cfg, C) -> float:
    """FLOPs of one update: forward + backward (3x forward) of every token through the
    decoder with causal attention, plus the LM head at the response positions only."""
    from actionopd_jax.model import flops_per_token

    seq = C.PROMPT_LEN + C.RESP_LEN
    body = flops_per_token(cfg, (seq + 1) / 2, training=True, with_lm_head=False) * C.TRAIN_BATCH * seq
    head = 3 * 2 * cfg.hidden_size * cfg.vocab_size * C.TRAIN_BATCH * C.RESP_LEN
    return body + head


def bench_ours(model_dir: Path, C, reps: int, micro: int, chunk: int, vocab_chunk: int, unroll: int,
               dtype: str = "float32") -> dict:
    import jax

    from actionopd_jax.model.weights import load_hf
    from actionopd_jax.train.batching import Row, pack_minibatch
    from actionopd_jax.train.step import StepSettings, TrainStep, make_optimizer, split_params

    cfg, model = load_hf(model_dir, cfg_overrides={"dtype": dtype, "scan_unroll": unroll})
    graphdef, params = split_params(model)
    prompts, responses, adv = C.train_batch()
    rows = [Row(p, r, float(a)) for p, r, a in zip(prompts, responses, adv)]
    mb = pack_minibatch(rows, list(range(len(rows))), microbatches=C.TRAIN_BATCH // micro, microbatch_rows=micro,
                        seq_len=C.PROMPT_LEN + C.RESP_LEN, resp_len=C.RESP_LEN)
    tx = make_optimizer(lr=C.LR, weight_decay=0.0, grad_clip=0.0)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    step = TrainStep(graphdef, params, mesh, tx, StepSettings(temperature=C.TEMPERATURE, clip_eps=0.2,
                                                              logits_chunk=chunk, vocab_chunk=vocab_chunk))
    state = step.init_state(params)
    batch = step.put_batch(mb.arrays)

    t = time.perf_counter()
    old, _ = step.old_logprobs(state["params"], batch)
    old.block_until_ready()
    old_first = time.perf_counter() - t
    t = time.perf_counter()
    old, _ = step.old_logprobs(state["params"], batch)
    old.block_until_ready()
    old_s = time.perf_counter() - t
    batch["old_logp"] = old

    def one():
        nonlocal state
        t0 = time.perf_counter()
        state, m = step.update(state, batch)
        loss = float(m["loss"])  # blocks until the update is done
        return time.perf_counter() - t0, loss

    warm, loss0 = one()
    times = []
    for i in range(reps):
        s, loss = one()
        times.append(s)
        print(f"ours train rep {i}: {s:.3f} s, loss {loss:.5f}", flush=True)
    res = C.train_summary(times, warm)
    res.update(loss_first=loss0, old_logprobs_s=round(old_s, 4), old_logprobs_first_s=round(old_first, 3),
               micro_rows=micro, logits_chunk=chunk, vocab_chunk=vocab_chunk, compute_dtype=dtype,
               scan_unroll=unroll)
    return res, cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="bench-tiny", choices=["bench-tiny", "bench-small"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--micro", type=int, default=8, help="rows per microbatch (32 = no accumulation)")
    ap.add_argument("--logits-chunk", type=int, default=0, help="response positions scored per chunk (0: all)")
    ap.add_argument("--vocab-chunk", type=int, default=8192, help="fused LM head chunk (0: plain logits)")
    ap.add_argument("--scan-unroll", type=int, default=0, help="layers per scan iteration (0: all)")
    ap.add_argument("--bf16-compute", action="store_true", help="also time bf16 compute (f32 master weights)")
    ap.add_argument("--skip-peers", action="store_true")
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
        if run_peer("transformers", pythons["transformers"], peer_dir, a.config, 0) is None:
            print(f"cannot create {model_dir}; run hf_bench.py of the harness with --config {a.config} first (or pass --hf-python)", file=sys.stderr)
            return 2

    import jax

    from actionopd_jax.model.weights import load_hf

    _, model = load_hf(model_dir)
    from flax import nnx
    import jax.numpy as jnp

    tokens = jnp.asarray(C.ref_input())
    hidden, _ = model(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))
    diff = float(np.max(np.abs(np.asarray(model.logits(hidden)) - np.load(model_dir / "ref_logits.npy"))))
    del model, hidden, nnx
    print(f"max |logits - ref_logits| = {diff:.2e}", flush=True)
    if diff > 1e-3:
        print("our logits do not match the harness's reference: not benchmarking", file=sys.stderr)
        return 1

    ours, cfg = bench_ours(model_dir, C, a.reps, a.micro, a.logits_chunk, a.vocab_chunk, a.scan_unroll)
    bf16 = None
    if a.bf16_compute:
        bf16, _ = bench_ours(model_dir, C, a.reps, a.micro, a.logits_chunk, a.vocab_chunk, a.scan_unroll,
                             "bfloat16")
    flops = needed_flops(cfg, C)
    peers = {}
    if not a.skip_peers:
        for name in PEERS:
            r = run_peer(name, pythons[name], peer_dir, a.config, a.reps)
            if r is not None and "train" in r:
                peers[name] = r["train"]
    peak = _run([sys.executable, str(peer_dir / "matmul_peak.py")], peer_dir, "matmul-peak")
    peak_gflops = peak["jax_dot"]["gflops_median"] if peak else None

    achieved = flops / ours["step_s"] / 1e9
    print(f"\n{a.config}: one update over 32 x (512 + 128) tokens, needed {flops / 1e12:.3f} TFLOP")
    print(f"{'system':<24}{'step s':>10}{'resp tok/s':>12}{'ours x faster':>15}")
    print(f"{'actionopd_jax (ours)':<24}{ours['step_s']:>10.3f}{ours['resp_tok_per_s']:>12.1f}{'':>15}")
    ratios = {}
    for name, r in peers.items():
        ratios[name] = round(r["step_s"] / ours["step_s"], 2)
        print(f"{name:<24}{r['step_s']:>10.3f}{r['resp_tok_per_s']:>12.1f}{ratios[name]:>15.2f}")
    if bf16:
        print(f"{'ours, bf16 compute *':<24}{bf16['step_s']:>10.3f}{bf16['resp_tok_per_s']:>12.1f}"
              f"{ours['step_s'] / bf16['step_s']:>14.2f}x vs ours f32")
        print("  * bfloat16 matmul operands, float32 accumulation and master weights; the peers run float32")
    pct = None
    if peak_gflops:
        pct = round(100 * achieved / peak_gflops, 1)
        print(f"\nours: {achieved:.1f} GFLOP/s of needed work = {pct}% of the jitted jnp.dot peak "
              f"({peak_gflops} GFLOP/s measured in this run)")
    print(f"old-logprob recompute (extra forward, not in step_s): {ours['old_logprobs_s']} s")
    C.emit(dict(system="actionopd_jax", config=a.config, jax=jax.__version__, max_logit_diff=diff, train=ours,
                train_bf16_compute=bf16,
                needed_tflop=round(flops / 1e12, 4), achieved_gflops=round(achieved, 1),
                matmul_peak_gflops=peak_gflops, pct_of_peak=pct, peers=peers, ratios=ratios, **C.machine()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
