"""Decode measurements of benchmarks/device_check.py: our two rollout paths (the paged engine and
the static sampler) and the outside reference, transformers' `generate` in PyTorch, on one
workload: `slots` rows = prompts x samples, prompt lengths drawn in [lo, hi], `max_new`
tokens each, no end token (every row runs every step), random bf16 weights.

Each returns the raw counts (seconds, tokens, the bytes one decode step must read); the
ratios against the measured copy bandwidth are taken in device_check.py, so a row rerun
without the ceilings stage says which bandwidth it was held to.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import numpy as np


def progress(what: str) -> None:
    """A step of a measurement, as it happens (device_check.py's child replaces this to record
    it too): a stage killed at its limit then says how far it got (run 2 on the H200 killed
    two engine stages that had printed nothing)."""
    print(f"[device_check]   {what}", file=sys.stderr, flush=True)


def workload(cfg_vocab: int, *, slots: int, samples: int, lo: int, hi: int, seed: int = 0):
    """(prompts, samples): slots // samples prompts of lengths spread evenly over [lo, hi]
    (shuffled), random ids."""
    prompts = max(1, slots // samples)
    rng = np.random.default_rng(seed)
    lens = np.linspace(lo, hi, prompts).round().astype(int)
    rng.shuffle(lens)
    return [rng.integers(10, cfg_vocab, size=int(n)).astype(np.int32) for n in lens], samples


def step_bytes(cfg, prompts, samples: int, max_new: int) -> dict:
    """Bytes one decode step must read at least: every weight once (bf16) and the KV cache the
    rows attend over (each prompt's once, shared by its samples, plus every row's generated
    tokens at their mean length max_new / 2)."""
    from actionopd_jax.model import count_params
    from actionopd_jax.sampling.budget import cache_bytes_per_token

    per_token = cache_bytes_per_token(cfg, "bfloat16")
    rows = len(prompts) * samples
    kv = per_token * (sum(len(p) for p in prompts) + rows * max_new / 2)
    return {"weight_bytes": 2 * count_params(cfg)["total"], "kv_bytes_mean": int(kv)}


def decode_timing(preset: str, *, slots: int, samples: int, lo: int, hi: int, max_new: int,
                  sampler: str, pool_pages: int | None = None, token_budget: int | None = None) -> dict:
    """Our decode on one device: sampler "engine" (paged, continuous batching, each prompt's
    pages shared by its samples) or "static" (one batched call, prompts padded to a bucket).
    The second call is timed (the first compiles). decode tokens/s = generated / decode s;
    end-to-end tokens/s counts prefill too. pool_pages: the engine's pool, token_budget: the
    static sampler's (None: one call), as device_check_shapes planned them for the device's memory."""
    from flax import nnx

    from actionopd_jax.model import PRESETS, Qwen3, make_mesh
    from actionopd_jax.model.runtime import RuntimeOptions

    device = jax.local_devices()[0]
    cfg = PRESETS[preset].replace(param_dtype="bfloat16")
    with jax.default_device(device):
        model = Qwen3(cfg, runtime=RuntimeOptions(dtype="bfloat16"), rngs=nnx.Rngs(0))
    mesh = make_mesh({"tensor": 1}, devices=[device])
    progress(f"{preset} built on {device.device_kind}")
    prompts, samples = workload(cfg.vocab_size, slots=slots, samples=samples, lo=lo, hi=hi)
    rows = len(prompts) * samples
    extra = {}
    if sampler == "engine":
        from actionopd_jax.engine import Engine, EngineConfig
        from actionopd_jax.engine.requests import pages_needed
        from actionopd_jax.engine.sizing import pool_pages as auto_pages

        # chunks of the longest prompt: a call whose lanes all start a prompt runs cuDNN's causal
        # attention, as static's prefill (programs.FRESH_PREFILL), not the decode kernel per token
        shapes = EngineConfig(slots=rows, page_size=16, max_len=hi + max_new, chunk=hi, segment=16)
        # the pool this workload fills (every row at once, each prompt's pages shared by its
        # samples) plus a quarter, within what the device holds (device_check_shapes): "auto"
        # takes 90% of what is free, which on the H200 left the decode segment's temporaries
        # no room at 256 slots (run 1: out of memory)
        if pool_pages is None:
            need = sum(a + b + (samples - 1) * c for a, b, c in
                       (pages_needed(len(p), max_new, samples, 0, shapes.page_size) for p in prompts))
            pool_pages = int(need * 1.25) + 1
        extra["pool_pages"] = int(pool_pages)
        extra["auto_pool_pages"] = auto_pages(cfg, shapes, mesh=mesh, dtype="bfloat16")
        shapes = dataclasses.replace(shapes, pages=extra["pool_pages"])
        s = Engine(model, eos_ids=[], config=shapes, mesh=mesh)
        pool_check(s, extra)
    else:
        from actionopd_jax.sampling import Sampler

        s = Sampler(model, eos_ids=[], mesh=mesh, token_budget=token_budget)
        extra["token_budget"] = token_budget
    kw = dict(n=samples, max_new_tokens=max_new, temperature=1.0, top_p=1.0, top_k=0)
    progress(f"{sampler} built{' with ' + str(extra['pool_pages']) + ' pages' if 'pool_pages' in extra else ''}; "
             "first call (compiles)")
    t0 = time.perf_counter()
    warm = s.sample(prompts, key=jax.random.key(0), **kw)  # compiles
    first = time.perf_counter() - t0
    progress(f"first call {first:.1f} s (prefill {warm.prefill_s:.1f} s, decode {warm.decode_s:.1f} s); timed call")
    t0 = time.perf_counter()
    res = s.sample(prompts, key=jax.random.key(1), **kw)
    wall = time.perf_counter() - t0
    tokens = int(res.generated_tokens)   # rows x max_new: no end token
    extra["programs"] = program_memory(s)
    stats = device.memory_stats() or {}
    extra["peak_bytes"] = stats.get("peak_bytes_in_use")     # this process's (each decode runs in its own)
    return {"model": preset, "sampler": sampler, "rows": rows, "prompts": len(prompts),
            "prompt_lens": [lo, hi], "prompt_tokens": int(sum(len(p) for p in prompts)), "max_new": max_new,
            "decode_steps": res.decode_steps, "prefill_s": round(res.prefill_s, 6), "decode_s": round(res.decode_s, 6),
            "wall_s": round(wall, 4), "first_call_s": round(first, 2), "generated_tokens": tokens,
            "decode_tokens": tokens,
            "tokens_per_s": round(tokens / res.decode_s, 1), "end_to_end_tokens_per_s": round(tokens / wall, 1),
            **step_bytes(cfg, prompts, samples, max_new), **extra,
            "ok": tokens == rows * max_new and res.decode_steps == max_new}


def pool_check(engine, extra: dict) -> None:
    """On a device that reports its memory, before the pool is allocated: the engine's programs
    compiled against it (kept for the run: nothing compiles twice), XLA's memory analysis of
    each in `extra["pool_needs"]`, and a pool that would not fit beside them refused with the
    numbers rather than run out of memory (engine/pool_fit.py, as an "auto" pool is sized)."""
    from actionopd_jax.engine.pool_fit import engine_needs
    from actionopd_jax.sampling.budget import cache_bytes_per_token, free_bytes_per_chip

    gib = 2 ** 30
    free = free_bytes_per_chip(engine.mesh)
    if free is None:   # the CPU (a dry run): no limit to check against, and its segments run at other row counts
        return
    needs = engine_needs(engine, engine.total_pages)
    extra["pool_needs"] = {n.kind: {"temp": round(n.temp / gib, 3), "generated_code": round(n.generated_code / gib, 3),
                                    "output_not_aliased": round(max(0, n.output - n.alias) / gib, 3),
                                    "argument": round(n.argument / gib, 3)} for n in needs}
    pool = engine.total_pages * engine.config.page_size * cache_bytes_per_token(engine.cfg, str(engine.dtype))
    beside = max((n.beside_arguments for n in needs), default=0)
    progress(f"pool {pool / gib:.2f} GiB + programs {beside / gib:.2f} GiB beside their arguments; "
             f"free {free / gib:.2f} GiB")
    if pool + beside > free:
        raise RuntimeError(f"the planned pool ({engine.total_pages} pages, {pool / gib:.2f} GiB) and the programs' "
                           f"needs beside their arguments ({beside / gib:.2f} GiB, XLA's memory analysis) exceed the "
                           f"free {free / gib:.2f} GiB")


def program_memory(sampler) -> dict:
    """XLA's memory analysis of each compiled program the sampler holds (GiB: arguments,
    outputs, aliased, temporaries): whether the pool is updated in place, and what a program
    needs beside its arguments (what a pool sized from free memory must leave)."""
    found = {}
    local = getattr(getattr(sampler, "programs", None), "_local", None)     # the engine: kind -> (weights, program)
    held = {k: p for k, (_, p) in local.items()} if local is not None else \
        {f"{k[0]} {i}": p for i, (k, p) in enumerate(getattr(sampler, "_programs", {}).items())}   # the static sampler: (kind, ...) -> program
    for kind, program in held.items():
        try:
            m = program.memory_analysis()
        except Exception as e:  # noqa: BLE001 - not every backend reports it
            found[kind] = f"{type(e).__name__}: {e}"[:200]
            continue
        if m is None:
            continue
        found[kind] = {name: round(getattr(m, f"{name}_size_in_bytes", 0) / 2 ** 30, 3)
                       for name in ("argument", "output", "alias", "temp", "generated_code")}
    return found


def transformers_timing(preset: str, *, slots: int, samples: int, lo: int, hi: int, max_new: int) -> dict:
    """transformers' `generate` (PyTorch, bf16, its default attention and dynamic KV cache) on the
    same workload: prompts left-padded to the longest, `num_return_sequences=samples`. A logits
    processor clocks every step (synchronising the GPU, as generate's own stopping check does
    each step): prefill = start -> first logits; decode = first -> last logits, max_new - 1
    steps of every row. A short warm-up call (8 tokens), then the timed call."""
    import torch
    import transformers

    from actionopd_jax.model import PRESETS

    cfg = PRESETS[preset]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                         if k not in ("architectures", "model_type", "torch_dtype", "dtype")})
    torch.manual_seed(0)
    t_built = time.perf_counter()
    with torch.device(dev):
        model = transformers.Qwen3ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    t_built = time.perf_counter() - t_built
    prompts, samples = workload(cfg.vocab_size, slots=slots, samples=samples, lo=lo, hi=hi)
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):   # left padding, as generate expects for a decoder-only model
        ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)

    class Clock(transformers.LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            if dev == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    def generate(new: int = max_new) -> tuple[float, list[float], int]:
        clock = Clock()
        kw = dict(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                  max_new_tokens=new, min_new_tokens=new, num_return_sequences=samples, pad_token_id=0,
                  eos_token_id=None, logits_processor=transformers.LogitsProcessorList([clock]))
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(**kw)
            if dev == "cuda":
                torch.cuda.synchronize()
        return t0, clock.times, int(out.shape[1] - width)

    progress(f"transformers model built in {t_built:.1f} s; warm-up")
    t_ready = time.perf_counter()
    generate(8)                      # warm-up (kernels, allocator): prefill and a few steps
    progress(f"warm-up {time.perf_counter() - t_ready:.1f} s; timed call")
    t0, times, steps = generate()
    wall = time.perf_counter() - t0
    rows = len(prompts) * samples
    decode_s = times[-1] - times[0]
    decode_tokens = rows * (len(times) - 1)
    return {"model": preset, "sampler": "transformers", "rows": rows, "prompts": len(prompts),
            "prompt_lens": [lo, hi], "prompt_tokens": int(sum(len(p) for p in prompts)), "max_new": max_new,
            "decode_steps": steps, "prefill_s": round(times[0] - t0, 6), "decode_s": round(decode_s, 6),
            "wall_s": round(wall, 4), "generated_tokens": rows * steps, "decode_tokens": decode_tokens,
            "tokens_per_s": round(decode_tokens / decode_s, 1), "end_to_end_tokens_per_s": round(rows * steps / wall, 1),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            **step_bytes(cfg, prompts, samples, max_new), "ok": steps == max_new and len(times) == max_new}
