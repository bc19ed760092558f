"""The device check's shapes, chosen from the lent device's memory (benchmarks/device_check.py).

The parent process reads the GPU's total memory from `nvidia-smi` (it never starts jax, so
it never holds the device) and plans every measurement with the project's own memory plans
before any of them runs:
- the train step: `train --check`'s plan (train/plan.estimate_memory) of the recipe's step
  (RECIPE: float32 master weights, remat "full") at each sequence length; where it does not
  fit the usable memory, the same step with bfloat16 master weights (the same FLOPs: what the
  step measures is unchanged), then the long step at half its length; a step no variant fits
  is left out, with its plan and the usable memory in the report. (Remat is already "full",
  the least memory: parameters, gradients and AdamW moments are ~90% of the 4B plan.)
- decode: the engine's pool is the pages the workload fills plus a quarter (each prompt's
  pages shared by its samples), kept within what is left after the weights (sizing.pages_for:
  budget.SAFETY of it); the static sampler's one call is planned with the prefill peak the
  H200 measured (GPU_PREFILL_FACTOR) and split into power-of-two prompt groups (its own token
  budget, sampling/budget.plan_chunks) where one call would not fit.
An H100 (80 GB) is so never asked for a step its plan does not fit (the H200's float32 16k
step where it plans over the H100's 71.7 usable GiB) or a 256-row static call that ran at
76.6 GiB. Without a memory figure (a dry run, a TPU host) the shapes are the
defaults (DECODE, TRAIN) as they were, and nothing is planned (the engine's pool is then
device_check_decode's: the workload's pages plus a quarter).
"""

from __future__ import annotations

import math
import shutil
import subprocess

# the workloads of each mode: (preset, slots, samples per prompt, prompt lengths lo-hi, new tokens)
DECODE = {"device": {"big": ("qwen3-4b", 256, 4, 1024, 4096, 256), "small": ("qwen3-4b", 64, 4, 1024, 4096, 256),
                     "0.6b": ("qwen3-0.6b", 256, 4, 1024, 4096, 256)},
          "dry-run": {"big": ("tiny", 8, 2, 16, 48, 8), "small": ("tiny", 4, 2, 16, 48, 8),
                      "0.6b": ("tiny", 6, 2, 16, 48, 8)}}
TRAIN = {"device": ("qwen3-4b", 4096, 16384, 512), "dry-run": ("tiny", 64, 128, 16)}  # preset, seq, long seq, resp
# Issue 42's XLA flag candidates for the train step, each timed as the first train step again
# in a process of its own (XLA reads XLA_FLAGS once, at start-up): label -> flags. cuBLAS-only
# GEMMs: XLA:GPU autotunes its Triton GEMMs against cuBLAS per shape, and JAX-Toolbox images
# once turned Triton GEMMs off by default. Not candidates: command buffers (the first step's
# profiled run has them off, so its split already times that against the row), the
# latency-hiding scheduler (it orders collectives; one GPU has none). Each flag parses under
# jax 0.10.2 (tests/test_device_check.py) and 0.11.2 (the device's jax, checked by hand).
TRAIN_XLA_FLAGS = {"cublas gemms": "--xla_gpu_enable_triton_gemm=false"}
# issue 42's layer-loop candidates for the first step: every layer unrolled (model.scan_unroll=0).
# Compiled for an H100 (4B, 4,096 tokens), the scanned update copies each trip's weight and
# saved-activation slices out of their stacks and writes the stacks, about 5.9 GiB of a
# layer's 7.8 outside its matmuls, 2.4 unrolled; unrolled, XLA's own rematerialization also
# fits remat "none" (64.8 GiB compiled, 95.7 scanned). Compiler figures: the device times them.
TRAIN_UNROLLED = {"unrolled": {"scan_unroll": 0}, "unrolled remat none": {"scan_unroll": 0, "remat": "none"}}
PAGE_SIZE = 16
POOL_MARGIN = 1.25    # pages beyond what the workload fills (its samples' own pages are allocated at admission)
# The static sampler's prefill peak per prompt-cache byte on a GPU (cache written + the
# compiler's temporaries), from XLA's memory analysis of the H200 run of 2026-12-04 (run 2,
# Qwen3-4B, prompts padded to 4,096): 256 rows (64 prompts) output 45.0 GiB + temps 24.1 =
# 1.67 x the 36.0 GiB prompt cache plus the 9.0 GiB generated cache; 64 rows 1.68. budget.
# PREFILL_FACTOR (1.25) is the TPU's: with it the 256-row call plans 61.5 GiB and ran at 76.6.
GPU_PREFILL_FACTOR = 1.68
# transformers' generate (PyTorch): its peak per byte of static cache, estimated (not yet measured:
# the row records torch's peak to calibrate it): at Qwen3-4B's 64 rows x 4,352 positions the
# cache is 38.3 GiB, and an eager prefill of 64 x 4,096 tokens holds about 16 GiB beside it
# (the MLP's three [tokens, 9,728] bf16 activations, q, k, v, the output, the padding mask)
TORCH_PREFILL_FACTOR = 1.45


def gpu_memory_bytes() -> int | None:
    """The least total memory of this host's GPUs (`nvidia-smi`, MiB), in bytes; None without
    nvidia-smi or where it answers nothing readable."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        mib = [int(float(line)) for line in out.split() if line.strip()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return min(mib) * 2 ** 20 if mib else None


def prompt_lengths(slots: int, samples: int, lo: int, hi: int) -> list[int]:
    """The workload's prompt lengths (device_check_decode.workload draws them in another order)."""
    import numpy as np

    return [int(n) for n in np.linspace(lo, hi, max(1, slots // samples)).round().astype(int)]


def _train_plan(preset: str, attention: str, seq: int, resp: int, param_dtype: str | None) -> float:
    import device_check_work as work
    from actionopd_jax.train.plan import estimate_memory
    from actionopd_jax.train.setup import model_config

    cfg = work.train_config(preset, attention, 1, seq, resp, None, param_dtype)
    return estimate_memory(cfg, model_config(cfg), {"data": 1, "fsdp": 1, "tensor": 1}, attention).total


def _auto_remat(preset: str, attention: str, seq: int, resp: int, usable: float) -> tuple[str, float] | None:
    """(policy, planned bytes) that `model.remat: auto` takes for the recipe's step at `seq`
    tokens on `usable` bytes (train/remat_choice, as `actionopd train` resolves it); None where
    no policy fits."""
    import device_check_work as work
    from actionopd_jax.config import ConfigError
    from actionopd_jax.train.remat_choice import choose_remat
    from actionopd_jax.train.setup import model_config

    cfg = work.train_config(preset, attention, 1, seq, resp, None, None)
    try:
        choice = choose_remat(cfg, model_config(cfg), {"data": 1, "fsdp": 1, "tensor": 1}, attention, usable)
    except ConfigError:
        return None
    return choice.policy, choice.estimate.total


def _decode_plan(work: str, spec: tuple, usable: float, platform: str, total: float) -> dict:
    from actionopd_jax.engine.requests import pages_needed
    from actionopd_jax.engine.sizing import EngineConfig, pages_for
    from actionopd_jax.model import PRESETS, count_params
    from actionopd_jax.sampling.budget import PREFILL_FACTOR, SAFETY, cache_bytes_per_token, chunk_tokens
    from actionopd_jax.sampling.buckets import Buckets

    preset, slots, samples, lo, hi, new = spec
    cfg = PRESETS[preset]
    lens = prompt_lengths(slots, samples, lo, hi)
    need = sum(a + b + (samples - 1) * c for a, b, c in (pages_needed(n, new, samples, 0, PAGE_SIZE) for n in lens))
    per_token = cache_bytes_per_token(cfg, "bfloat16")
    weights = 2 * count_params(cfg)["total"]
    out = {"work": work, "pool_pages_needed": need + 1, "pool_pages": int(need * POOL_MARGIN) + 1,
           "weight_bytes": weights, "static_calls": 1, "static_token_budget": None}
    plen = Buckets.fit(hi, Buckets().prompt_len, "prompt_len")
    factor = GPU_PREFILL_FACTOR if platform == "gpu" else PREFILL_FACTOR
    call = lambda p: per_token * chunk_tokens(p, plen, samples, new, factor)  # noqa: E731 - one call of p prompts
    shapes = EngineConfig(slots=slots, page_size=PAGE_SIZE, max_len=hi + new, chunk=min(512, hi))
    try:
        room = pages_for(cfg, shapes, usable - weights, dtype="bfloat16")
    except ValueError:
        room = 0
    out["pool_pages"] = min(out["pool_pages"], room)
    out["engine_plan_bytes"] = weights + out["pool_pages"] * PAGE_SIZE * per_token
    if out["pool_pages"] < out["pool_pages_needed"]:
        out["engine_dropped"] = (f"the pool the workload fills ({out['pool_pages_needed']} pages of {PAGE_SIZE}, "
                                 f"{out['pool_pages_needed'] * PAGE_SIZE * per_token / 2 ** 30:.1f} GiB) does not fit "
                                 f"beside the weights ({weights / 2 ** 30:.1f} GiB) in {SAFETY:.0%} of the rest of "
                                 f"the usable {usable / 2 ** 30:.1f} GiB")
    prompts = len(lens)
    out["torch_prompts_per_call"] = _torch_prompts_per_call(prompts, samples, hi + new, per_token, weights, total)
    group = _halved_to_fit(prompts, lambda p: call(p) <= SAFETY * (usable - weights))
    out["static_plan_bytes"] = weights + call(group)
    if call(group) > SAFETY * (usable - weights):
        out["static_dropped"] = (f"one prompt's call plans {call(1) / 2 ** 30:.1f} GiB beside the weights "
                                 f"({weights / 2 ** 30:.1f} GiB); {SAFETY:.0%} of the rest of the usable "
                                 f"{usable / 2 ** 30:.1f} GiB is less")
    elif group < prompts:
        # the sampler's own budget, in its units (budget.PREFILL_FACTOR): exactly `group` prompts a call
        out["static_calls"] = math.ceil(prompts / group)
        out["static_token_budget"] = int(chunk_tokens(group, plen, samples, new))
    return out


def _torch_prompts_per_call(prompts: int, samples: int, positions: int, per_token: int, weights: int,
                            total: float) -> int:
    """Prompts a transformers `generate` call takes (all, else the largest power of two that
    fits, at least one: a call that runs out of memory is halved, device_check_decode): its
    static cache (every row at `positions`) times TORCH_PREFILL_FACTOR within SAFETY of the
    memory beside the weights. torch is not held to XLA's share (its process keeps jax from
    preallocating), so the device's `total` counts."""
    from actionopd_jax.sampling.budget import SAFETY

    fits = lambda p: TORCH_PREFILL_FACTOR * p * samples * positions * per_token <= SAFETY * (total - weights)  # noqa: E731
    return prompts if fits(prompts) else _halved_to_fit(prompts, fits)


def _halved_to_fit(prompts: int, fits) -> int:
    """The largest power of two <= prompts, halved while a call of that many does not fit
    (`fits(p)`), down to 1 (the caller says whether 1 fits)."""
    group = 1 << (prompts.bit_length() - 1)
    while group > 1 and not fits(group):
        group //= 2
    return group


def choose(mode: str, platform: str, memory_bytes: int | None, source: str = "") -> dict:
    """The train steps and decode workloads to run in `mode` on a device of `memory_bytes`
    (None: unknown, the defaults), each with its planned peak (bytes per device): "train" a
    list of {attention, seq, param_dtype (None: the recipe's), plan_bytes}; "decode" per
    workload its pool pages, static calls and plans; "dropped" what fits no variant, and why.
    A train entry with "remat" runs under that policy (auto's choice), else the recipe's."""
    dev = mode == "device"
    fraction = None
    if dev and memory_bytes:
        from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION as fraction
    usable = memory_bytes * fraction if fraction else None
    fast = {"gpu": "cudnn", "tpu": "splash"}.get(platform, "cpu") if dev else "cpu"
    preset, seq, long_seq, resp = TRAIN[mode]
    out = {"memory_bytes": memory_bytes if dev else None, "source": source if dev and memory_bytes else
           "none (the default shapes)", "usable_bytes": usable, "usable_fraction": fraction,
           "preset": preset, "resp": resp, "train": [], "decode": {}, "dropped": []}
    if usable is not None and fast in ("cudnn", "splash"):
        # issue 42's rows first: the step under the policy `model.remat: auto` picks for this
        # device's memory, where that is not the recipe's "full" (timed beside it below)
        for s in dict.fromkeys((seq, long_seq)):
            auto = _auto_remat(preset, fast, s, resp, usable)
            if auto is not None and auto[0] != "full":
                out["train"].append({"attention": fast, "seq": s, "param_dtype": None, "remat": auto[0],
                                     "plan_bytes": auto[1]})
    for attention, s in dict.fromkeys(((fast, seq), ("xla", seq), (fast, long_seq))):
        if usable is None:
            out["train"].append({"attention": attention, "seq": s, "param_dtype": None, "plan_bytes": None})
            continue
        lengths = (s, s // 2) if s == long_seq and long_seq > seq else (s,)
        tried = []
        for length in lengths:
            for dtype in (None, "bfloat16"):      # the recipe's float32 master weights first
                plan = _train_plan(preset, attention, length, resp, dtype)
                tried.append(f"{length} tokens {dtype or 'float32'} {plan / 2 ** 30:.1f} GiB")
                if plan <= usable:
                    break
            if plan <= usable:
                out["train"].append({"attention": attention, "seq": length, "param_dtype": dtype, "plan_bytes": plan})
                break
        else:
            out["dropped"].append({"stage": f"train {preset} {attention} {s}",
                                   "why": f"no plan fits the usable {usable / 2 ** 30:.1f} GiB: {'; '.join(tried)}"})
    for work, spec in DECODE[mode].items():
        if usable is None:   # decode_timing's own rule; nothing imported (a dry run's parent stays light)
            # a dry run's generate calls take a prompt each: the calls' path runs at tiny shapes
            out["decode"][work] = {"work": work, "pool_pages": None, "static_calls": 1, "static_token_budget": None,
                                   "torch_prompts_per_call": 1 if not dev else None}
            continue
        out["decode"][work] = plan = _decode_plan(work, spec, usable, platform, memory_bytes)
        for sampler in ("engine", "static"):
            if f"{sampler}_dropped" in plan:
                out["dropped"].append({"stage": f"decode {spec[0]} {sampler} {spec[1]}",
                                       "why": plan[f"{sampler}_dropped"]})
    return out


def only(plan: list, shapes: dict, names: str) -> tuple[list, str]:
    """(the measurements of `plan` named in `names` (comma-separated), in that order; "") or
    ([], why not): a name the plan left out for this device's memory, or no such measurement."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = sorted(set(wanted) - {name for name, _, _, _ in plan})
    left_out = [d for d in shapes["dropped"] if d["stage"] in unknown]
    if left_out:
        return [], "; ".join(f"{d['stage']}: not planned on this device ({d['why']})" for d in left_out)
    if unknown:
        return [], (f"{', '.join(unknown)}: no such measurement; the measurements are: "
                    f"{', '.join(name for name, _, _, _ in plan)}")
    by_name = {row[0]: row for row in plan}
    return [by_name[n] for n in dict.fromkeys(wanted)], ""


__all__ = ["DECODE", "GPU_PREFILL_FACTOR", "TORCH_PREFILL_FACTOR", "TRAIN", "choose", "gpu_memory_bytes", "only", "prompt_lengths"]
