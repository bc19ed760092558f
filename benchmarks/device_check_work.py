"""The measurements of benchmarks/device_check.py, run on the accelerator (or, --dry-run, on
this CPU at tiny shapes). Each returns plain dicts for the JSON; `ok` says whether a check
passed. Imported by device_check.py after the matching jax is installed."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

# published per-chip figures (dense bf16 FLOP/s, HBM bytes/s), matched on jax's device_kind
PEAKS = (("H200", 989e12, 4.8e12), ("H100", 989e12, 3.35e12), ("A100", 312e12, 2.039e12),
         ("L4", 121e12, 0.3e12), ("TPU v5p", 459e12, 2.765e12), ("TPU v5 lite", 197e12, 0.819e12),
         ("TPU v5e", 197e12, 0.819e12), ("TPU v6", 918e12, 1.64e12), ("TPU v4", 275e12, 1.2e12))
# forward / gradient tolerance of the fast kernel against xla, relative to the largest |value|
# (both in bfloat16; measured errors are in the JSON)
FWD_TOL, GRAD_TOL = 2e-2, 5e-2


def peaks(device) -> tuple[float | None, float | None]:
    kind = getattr(device, "device_kind", "")
    for name, flops, bw in PEAKS:
        if name.lower() in kind.lower():
            return flops, bw
    return None, None


def fast_kernel(platform: str) -> str:
    return {"gpu": "cudnn", "tpu": "splash"}.get(platform, "cpu")


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6))


def attention_parity(platform: str, *, batch: int, seq: int, kv_heads: int, groups: int, head_dim: int) -> dict:
    """The platform's fused kernel against "xla" on the device: forward and the gradients of
    q, k, v, right-padded rows (the second row's last quarter is padding)."""
    from actionopd_jax.model.attention import causal_self_attention

    impl = fast_kernel(platform)
    keys = jax.random.split(jax.random.key(0), 4)
    dt = jnp.bfloat16
    q = jax.random.normal(keys[0], (batch, seq, kv_heads, groups, head_dim), dt)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), dt)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), dt)
    lengths = np.full((batch,), seq)
    lengths[-1] = seq - seq // 4
    mask = jnp.asarray(np.arange(seq)[None, :] < lengths[:, None])
    cot = jax.random.normal(keys[3], q.shape, jnp.float32)

    def run(which):
        def loss(q, k, v):
            out = causal_self_attention(q, k, v, mask, dt, which)
            return (out.astype(jnp.float32) * cot * mask[:, :, None, None, None]).sum(), out
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out * mask[:, :, None, None, None].astype(dt), grads

    t0 = time.perf_counter()
    out, grads = run(impl)
    ref, ref_grads = run("xla")
    fwd = _rel(out, ref)
    grad = max(_rel(g, r) for g, r in zip(grads, ref_grads))
    return {"check": f"attention {impl} vs xla", "shape": [batch, seq, kv_heads * groups, kv_heads, head_dim],
            "forward_rel_err": fwd, "grad_rel_err": grad, "ok": fwd <= FWD_TOL and grad <= GRAD_TOL,
            "seconds": round(time.perf_counter() - t0, 2)}


def _tiny_sampler(device, dtype: str, attention: str, backend: str):
    from flax import nnx

    from actionopd_jax.model import PRESETS, Qwen3, make_mesh
    from actionopd_jax.model.runtime import RuntimeOptions
    from actionopd_jax.sampling import Sampler

    cfg = PRESETS["tiny"]
    with jax.default_device(device):
        model = Qwen3(cfg, runtime=RuntimeOptions(dtype=dtype, attention=attention), rngs=nnx.Rngs(0))
    mesh = make_mesh({"tensor": 1}, devices=[device])
    return Sampler(model, eos_ids=[], mesh=mesh, backend=backend, token_budget=None)


def sampler_parity(device, *, prompts: int = 4, max_new: int = 24, bf16: bool = True) -> list[dict]:
    """Greedy tokens of the tiny model (seed-0 weights) on the device against the CPU
    backend on this host's CPU: float32 with xla attention at the highest matmul precision
    must give the same tokens; bfloat16 with the platform's fused kernel is reported (rounding
    differs between devices, so near-ties may flip; bf16=False skips it: the dry run's CPU is both sides)."""
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    lens = [5, 17, 33, 64][:prompts]
    batch = [rng.integers(10, 2000, size=n).astype(np.int32) for n in lens]
    out = []
    for dtype, attention, exact in (("float32", "xla", True), ("bfloat16", "auto", False))[:2 if bf16 else 1]:
        tokens = {}
        # the device runs the accelerator path (the only one on GPU/TPU; forced in a dry run on CPU)
        for name, dev, backend in (("device", device, "accelerator"), ("cpu", cpu, "cpu")):
            with jax.default_matmul_precision("highest"):
                s = _tiny_sampler(dev, dtype, attention if name == "device" else "auto", backend)
                res = s.sample(batch, n=2, max_new_tokens=max_new, temperature=0.0, key=jax.random.key(1))
            tokens[name] = [g.token_ids.tolist() for gens in res.generations for g in gens]
        same = sum(a == b for a, b in zip(tokens["device"], tokens["cpu"]))
        out.append({"check": f"sampler tokens {dtype} ({attention}) device vs CPU", "rows_equal": same,
                    "rows": len(tokens["cpu"]), "ok": (same == len(tokens["cpu"])) if exact else True,
                    "exact_required": exact})
    return out


def _train_config(preset: str, attention: str, rows: int, seq: int, resp: int, remat: str):
    from pathlib import Path

    from actionopd_jax.config.load import load_config

    recipe = Path(__file__).resolve().parents[1] / "configs/paper/qwen3_4b_tpu.yaml"
    return load_config(recipe, [
        f"model.preset={preset}", "model.hf_path=", f"model.attention={attention}", f"model.remat={remat}",
        "mesh.target=", "mesh.fsdp=-1", "train.shared_prompt=false", f"train.microbatch_rows={rows}",
        f"train.max_seq_len={seq}", f"collect.max_response_tokens={resp}", "train.logits_chunk=512"])


def train_step_timing(preset: str, attention: str, *, rows: int, seq: int, resp: int, reps: int,
                      remat: str = "full", devices: list | None = None) -> dict:
    """One optimizer update of `preset` (random weights) over all local devices (FSDP):
    compile time, step time, tokens/s, MFU; peak device memory against the analytic plan."""
    from actionopd_jax.model import make_mesh
    from actionopd_jax.train.aot_check import model_flops
    from actionopd_jax.train.batching import Row, pack_minibatch
    from actionopd_jax.train.plan import estimate_memory
    from actionopd_jax.train.setup import build_train_step, initial_params, model_config

    devices = devices or jax.local_devices()
    cfg = _train_config(preset, attention, rows, seq, resp, remat)
    qcfg = model_config(cfg)
    mesh = make_mesh({"fsdp": len(devices)}, devices=devices)
    step = build_train_step(cfg, qcfg, mesh)
    state = step.init_state(initial_params(cfg, qcfg, mesh))
    rng = np.random.default_rng(0)
    data = [Row(rng.integers(10, qcfg.vocab_size, size=seq - resp).astype(np.int32),
                rng.integers(10, qcfg.vocab_size, size=resp).astype(np.int32), 1.0) for _ in range(rows)]
    mb = pack_minibatch(data, list(range(rows)), microbatches=1, microbatch_rows=rows, seq_len=seq, resp_len=resp)
    mb.arrays["old_logp"] = np.full_like(mb.arrays["old_logp"], -1.0)
    batch = step.put_batch(mb.arrays)
    t0 = time.perf_counter()
    state, m = step.update(state, batch)
    loss = float(m["loss"])
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        state, m = step.update(state, batch)
        float(m["loss"])
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    flops, _ = peaks(devices[0])
    used = model_flops(qcfg, rows, seq, resp)
    stats = devices[0].memory_stats() or {}
    plan = estimate_memory(cfg, qcfg, {"data": 1, "fsdp": len(devices), "tensor": 1}, attention).total
    del state, batch
    return {"model": preset, "attention": attention, "devices": len(devices), "rows": rows, "seq_len": seq,
            "resp_len": resp, "remat": remat, "compile_s": round(compile_s, 2), "step_s": round(step_s, 4),
            "tokens_per_s": round(rows * seq / step_s, 1), "loss": loss,
            "mfu": None if flops is None else round(used / (step_s * flops * len(devices)), 4),
            "peak_bytes": stats.get("peak_bytes_in_use"), "plan_bytes": plan,
            "ok": bool(np.isfinite(loss))}


def decode_timing(preset: str, *, prompts: int, prompt_len: int, samples: int, max_new: int,
                  sampler: str = "static") -> dict:
    """Decode tokens/s on one device (bf16 weights, no end token so every row runs max_new
    steps) against the HBM bound: each step reads every weight once plus the KV cache it
    attends over (the prompt's, once per prompt, and the generated slots). sampler: "static"
    (sampling.Sampler, one batched call) or "engine" (the paged continuous-batching engine,
    every state in its own slots, the same workload); the second call of each is timed."""
    from flax import nnx

    from actionopd_jax.model import PRESETS, Qwen3, count_params, make_mesh
    from actionopd_jax.model.runtime import RuntimeOptions
    from actionopd_jax.sampling.budget import cache_bytes_per_token

    device = jax.local_devices()[0]
    cfg = PRESETS[preset].replace(param_dtype="bfloat16")
    with jax.default_device(device):
        model = Qwen3(cfg, runtime=RuntimeOptions(dtype="bfloat16"), rngs=nnx.Rngs(0))
    mesh = make_mesh({"tensor": 1}, devices=[device])
    rows = prompts * samples
    if sampler == "engine":
        from actionopd_jax.engine import Engine, EngineConfig

        shapes = EngineConfig(slots=rows, page_size=16, max_len=prompt_len + max_new, chunk=min(512, prompt_len),
                              segment=16)
        s = Engine(model, eos_ids=[], config=shapes, mesh=mesh)
    else:
        from actionopd_jax.sampling import Sampler

        s = Sampler(model, eos_ids=[], mesh=mesh, token_budget=None)
    rng = np.random.default_rng(0)
    batch = [rng.integers(10, cfg.vocab_size, size=prompt_len).astype(np.int32) for _ in range(prompts)]
    kw = dict(n=samples, max_new_tokens=max_new, temperature=1.0, top_p=1.0, top_k=0)
    first = s.sample(batch, key=jax.random.key(0), **kw)  # compiles
    res = s.sample(batch, key=jax.random.key(1), **kw)
    tokens = res.generated_tokens   # rows x max_new: no end token
    tok_s = tokens / res.decode_s
    _, bw = peaks(device)
    per_token = cache_bytes_per_token(cfg, "bfloat16")
    weights = 2 * count_params(cfg)["total"]
    kv_step = per_token * (prompts * prompt_len + rows * max_new / 2)  # mean generated length
    bound = None if bw is None else rows * bw / (weights + kv_step)
    return {"model": preset, "sampler": sampler, "rows": rows, "prompt_len": prompt_len, "max_new": max_new,
            "decode_steps": res.decode_steps, "decode_s": round(res.decode_s, 4), "generated_tokens": int(tokens),
            "first_call_s": round(first.prefill_s + first.decode_s, 2), "tokens_per_s": round(tok_s, 1),
            "hbm_bound_tokens_per_s": None if bound is None else round(bound, 1),
            "fraction_of_bound": None if bound is None else round(tok_s / bound, 4),
            "ok": tok_s > 0 and res.decode_steps == max_new}
