"""The measurements of benchmarks/device_check.py, run on the accelerator (or, --dry-run, on
this CPU at tiny shapes): the ceilings, attention and sampler parity, the train step. Decode
and the transformers reference are in device_check_decode.py. Each returns plain dicts for the
JSON; `ok` says whether a check passed. Each imports only what it uses: the device host has
jax, flax, optax, orbax, transformers and torch, and not our client-side packages (openai,
grain, mcp, ...; tests/test_device_check.py holds us to that)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from device_check_report import published_peaks   # stdlib-only module beside this one

# forward / gradient tolerance of the fast kernel against xla, relative to the largest |value|
# (both in bfloat16; measured errors are in the JSON)
FWD_TOL, GRAD_TOL = 2e-2, 5e-2


def peaks(device) -> tuple[float | None, float | None]:
    return published_peaks(getattr(device, "device_kind", ""))


def fast_kernel(platform: str) -> str:
    return {"gpu": "cudnn", "tpu": "splash"}.get(platform, "cpu")


def queued_time(fn, arg, reps: int, rounds: int = 3) -> float:
    """Seconds per call of `reps` calls queued back to back (one wait at the end), the best of
    `rounds`: a ceiling without the host's per-call launch and wait, which timing single calls
    counted (on the H200 a 4 GiB copy timed alone gave 2.75 TB/s, 0.64x the 4.3 seen with torch)."""
    jax.block_until_ready(fn(arg))  # compile and warm up
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = [fn(arg) for _ in range(reps)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - t0) / reps)
        del outs
    return best


def ceilings(device, *, copy_mib: int, matmul_n: int, reps: int = 10) -> dict:
    """The two measured ceilings every later ratio is taken against: device memory bandwidth
    (an elementwise pass over a bf16 array of `copy_mib` MiB: every byte read once and written
    once, counted both ways) and a bf16 matmul (n x n x n on random data, 2 n^3 FLOPs), each
    timed over calls queued back to back (`queued_time`)."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    with jax.default_device(device):
        x = jax.random.normal(k1, (copy_mib * 2 ** 19,), jnp.bfloat16)   # 2 bytes an element
        a = jax.random.normal(k2, (matmul_n, matmul_n), jnp.bfloat16)
        b = jax.random.normal(k3, (matmul_n, matmul_n), jnp.bfloat16)
    copy_s = queued_time(jax.jit(lambda x: x + jnp.bfloat16(1)), x, reps)
    matmul_s = queued_time(jax.jit(lambda a: a @ b), a, reps)
    flops, bw = peaks(device)
    copy_bw = 2 * x.nbytes / copy_s
    rate = 2 * matmul_n ** 3 / matmul_s
    return {"check": "ceilings", "copy_bytes": 2 * x.nbytes, "copy_s": round(copy_s, 6),
            "copy_bytes_per_s": round(copy_bw), "matmul_n": matmul_n, "matmul_s": round(matmul_s, 6),
            "matmul_flops_per_s": round(rate), "published_flops_per_s": flops, "published_bytes_per_s": bw,
            "ok": bool(np.isfinite(copy_bw) and np.isfinite(rate) and copy_bw > 0 and rate > 0)}


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


def _tiny_sampler(device, dtype: str, attention: str, backend: str, kind: str = "static"):
    from flax import nnx

    from actionopd_jax.model import PRESETS, Qwen3, make_mesh
    from actionopd_jax.model.runtime import RuntimeOptions
    from actionopd_jax.sampling import Sampler

    cfg = PRESETS["tiny"]
    with jax.default_device(device):
        model = Qwen3(cfg, runtime=RuntimeOptions(dtype=dtype, attention=attention), rngs=nnx.Rngs(0))
    mesh = make_mesh({"tensor": 1}, devices=[device])
    if kind == "engine":
        from actionopd_jax.engine import Engine, EngineConfig

        return Engine(model, eos_ids=[], config=EngineConfig(slots=8, page_size=16, max_len=128, chunk=64), mesh=mesh)
    return Sampler(model, eos_ids=[], mesh=mesh, backend=backend, token_budget=None)


def sampler_parity(device, *, prompts: int = 4, max_new: int = 24, bf16: bool = True) -> list[dict]:
    """Greedy tokens of the tiny model (seed-0 weights) on the device against the static
    sampler's on this host's CPU (the oracle): float32 with xla attention at the highest
    matmul precision must give the same tokens, from the static sampler and from the engine
    (its paged attention the platform's own); bfloat16 with the platform's fused kernel is
    reported (rounding differs between devices, so near-ties may flip; bf16=False skips it)."""
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    lens = [5, 17, 33, 64][:prompts]
    batch = [rng.integers(10, 2000, size=n).astype(np.int32) for n in lens]

    def tokens(dev, dtype, attention, backend, kind="static"):
        with jax.default_matmul_precision("highest"):
            s = _tiny_sampler(dev, dtype, attention, backend, kind)
            res = s.sample(batch, n=2, max_new_tokens=max_new, temperature=0.0, key=jax.random.key(1))
        return [g.token_ids.tolist() for gens in res.generations for g in gens]

    out = []
    runs = [("float32", "xla", "static", True), ("float32", "xla", "engine", True),
            ("bfloat16", "auto", "static", False)][:3 if bf16 else 2]
    oracle = {}
    for dtype, attention, kind, exact in runs:
        if dtype not in oracle:
            oracle[dtype] = tokens(cpu, dtype, "auto", "cpu")
        # the device runs the accelerator path (the only one on GPU/TPU; forced in a dry run on CPU)
        got = tokens(device, dtype, attention, "accelerator", kind)
        same = sum(a == b for a, b in zip(got, oracle[dtype]))
        label = "sampler" if kind == "static" else "engine"
        out.append({"check": f"{label} tokens {dtype} ({attention}) device vs CPU", "rows_equal": same,
                    "rows": len(oracle[dtype]), "ok": (same == len(oracle[dtype])) if exact else True,
                    "exact_required": exact})
    return out


RECIPE = "configs/paper/qwen3_4b_h200.yaml"   # the train step is timed as this recipe sets it (remat, dtypes)


def train_config(preset: str, attention: str, rows: int, seq: int, resp: int, remat: str | None,
                 param_dtype: str | None = None, scan_unroll: int | None = None):
    """RECIPE at these shapes; `remat` / `param_dtype` / `scan_unroll`: the recipe's where None."""
    from actionopd_jax.config.load import load_config

    recipe = Path(__file__).resolve().parents[1] / RECIPE
    return load_config(recipe, [
        f"model.preset={preset}", "model.hf_path=", f"model.attention={attention}",
        *([f"model.remat={remat}"] if remat else []), *([f"model.param_dtype={param_dtype}"] if param_dtype else []),
        *([f"model.scan_unroll={scan_unroll}"] if scan_unroll is not None else []),
        # one microbatch, as train_step_timing packs it: the plan then counts one gradient
        # buffer, not the accumulator of the recipe's 256-row minibatch beside it
        "mesh.target=", "mesh.fsdp=-1", "train.shared_prompt=false", f"train.microbatch_rows={rows}",
        f"train.minibatch_rows={rows}",
        f"train.max_seq_len={seq}", f"collect.max_response_tokens={resp}", "train.logits_chunk=512"])


def train_step_timing(preset: str, attention: str, *, rows: int, seq: int, resp: int, reps: int,
                      remat: str | None = None, param_dtype: str | None = None, devices: list | None = None,
                      split: bool = False, scan_unroll: int | None = None) -> dict:
    """One optimizer update of `preset` (random weights) over all local devices (FSDP), remat
    as RECIPE sets it unless `remat` is given ("auto": train/remat_choice's policy for this
    device's usable memory, recorded as the row's remat): compile time, step time, tokens/s, the model
    FLOPs of the step (MFU is taken in device_check.py against the measured matmul ceiling);
    `param_dtype`: the master weights' dtype where the recipe's does not fit (device_check_shapes);
    a given `remat` on an accelerator is first confirmed by compiling the update against the
    device's limit (train/remat_confirm.py; the row's remat_compiled: each policy compiled);
    peak device memory against the analytic plan of `train --check`. split: then one more step
    under the profiler, its time by kind (train/time_split.py; an error there is the split's,
    not the row's). scan_unroll: layers per trip of the layer loop where not the recipe's (0:
    all unrolled; the row records it)."""
    from actionopd_jax.model import make_mesh
    from actionopd_jax.train.aot_check import model_flops
    from actionopd_jax.train.batching import Row, pack_minibatch
    from actionopd_jax.train.plan import estimate_memory
    from actionopd_jax.train.setup import build_train_step, initial_params, model_config

    devices = devices or jax.local_devices()
    cfg = train_config(preset, attention, rows, seq, resp, remat, param_dtype, scan_unroll)
    qcfg = model_config(cfg)
    if cfg.model.remat == "auto":  # as `actionopd train` resolves it: from this device's usable memory
        from actionopd_jax.train.remat_choice import resolve_remat

        cfg, _ = resolve_remat(cfg, qcfg, {"data": 1, "fsdp": len(devices), "tensor": 1}, platform=devices[0].platform,
                               usable_bytes=(devices[0].memory_stats() or {}).get("bytes_limit"))
    mesh = make_mesh({"fsdp": len(devices)}, devices=devices)
    compiled = None
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    if remat and limit and devices[0].platform != "cpu":
        # the plan's choice confirmed by XLA's compile of the update, as `actionopd train` does
        # (train/remat_confirm.py): a policy over this device's limit steps down to the next
        from actionopd_jax.train.remat_confirm import confirm_by_compile

        cfg, _, tried = confirm_by_compile(cfg, qcfg, mesh, attention=attention, usable_bytes=limit)
        compiled = [dataclasses.asdict(t) for t in tried]
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
    # Kept to significant digits, not decimals: a tiny model steps in well under a millisecond on a
    # GPU, where four decimals would skew tokens/s and MFU derived from the report (or zero them).
    step_s = float(np.median(times))
    used = model_flops(qcfg, rows, seq, resp)
    stats = devices[0].memory_stats() or {}
    plan = estimate_memory(cfg, qcfg, {"data": 1, "fsdp": len(devices), "tensor": 1}, attention).total
    extra = {}
    if split:   # after the peak was read: the profiled program is a second compile of the same step
        from actionopd_jax.train.time_split import profile_update

        try:
            extra["split"], state = profile_update(step, state, batch)
        except Exception as e:  # noqa: BLE001 - the timed step stands; the split says why it is missing
            extra["split"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    del state, batch
    from actionopd_jax.config.load import load_config

    whole = load_config(Path(__file__).resolve().parents[1] / RECIPE, ["model.hf_path=", "mesh.target="]).train
    extra["recipe_microbatches"] = whole.minibatch_rows // whole.microbatch_rows   # in the recipe's own update
    return {"model": preset, "attention": attention, "devices": len(devices), "rows": rows, "seq_len": seq,
            "resp_len": resp, "remat": cfg.model.remat, "param_dtype": cfg.model.param_dtype,
            "compile_s": round(compile_s, 2), "step_s": float(f"{step_s:.6g}"),
            "tokens_per_s": round(rows * seq / step_s, 1), "loss": loss, "model_flops": used,
            "peak_bytes": stats.get("peak_bytes_in_use"), "plan_bytes": plan,
            **({"remat_compiled": compiled, "bytes_limit": limit} if compiled else {}), **extra,
            **({"scan_unroll": scan_unroll} if scan_unroll is not None else {}),
            "ok": bool(np.isfinite(loss))}
