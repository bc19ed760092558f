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


WARM_PROMPTS = 4   # the engine's first call: its longest prompts (its programs' shapes are its own)
_COMPILES = []     # backend compiles in this process (jax.monitoring), once counting


def compiles() -> int:
    """XLA compiles so far in this process: a timed call that compiled is not a timing. The
    event times jax's compile-or-load, so a program loaded from the persistent compilation
    cache (device_check_host.start_cache) counts too: a load takes seconds as well."""
    if not _COMPILES:
        _COMPILES.append(0)

        def count(event, duration, **_):
            if event == "/jax/core/compile/backend_compile_duration":
                _COMPILES[0] += 1
        jax.monitoring.register_event_duration_secs_listener(count)
    return _COMPILES[0]


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


def build(preset: str, sampler: str, *, slots: int, samples: int, lo: int, hi: int, max_new: int,
          pool_pages: int | None = None, token_budget: int | None = None, options: dict | None = None):
    """(the sampler, the model's config, the device, the workload's prompts, rows, the row's
    extra fields) for decode_timing's workload on one device, random bf16 weights. options: XLA
    options the engine's programs compile with beside their own (a profile's)."""
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
        s.programs.options = dict(options or {})
        pool_check(s, extra)
    else:
        from actionopd_jax.sampling import Sampler

        s = Sampler(model, eos_ids=[], mesh=mesh, token_budget=token_budget)
        extra["token_budget"] = token_budget
    return s, cfg, device, prompts, rows, extra


def first_call(engine, prompts: list, kw: dict) -> tuple[list, dict]:
    """The engine's compiling first call: its WARM_PROMPTS longest prompts for at most two
    segments (its programs have the engine's shapes, not the workload's)."""
    return (sorted(prompts, key=len)[-WARM_PROMPTS:],
            {**kw, "max_new_tokens": min(kw["max_new_tokens"], 2 * engine.config.segment)})


def decode_timing(preset: str, *, slots: int, samples: int, lo: int, hi: int, max_new: int,
                  sampler: str, pool_pages: int | None = None, token_budget: int | None = None) -> dict:
    """Our decode on one device: sampler "engine" (paged, continuous batching, each prompt's
    pages shared by its samples) or "static" (one batched call, prompts padded to a bucket).
    The second call is timed (the first compiles: static's the whole workload, whose shapes
    are its programs'; the engine's only its WARM_PROMPTS longest prompts for a few segments,
    as its programs have the engine's shapes, and its prefix cache is dropped after it, so the
    timed call prefills every prompt token as static and generate do). A timed call that
    compiled anything is timed once more. decode tokens/s = generated / decode s;
    end-to-end tokens/s counts prefill too. pool_pages: the engine's pool, token_budget: the
    static sampler's (None: one call), as device_check_shapes planned them for the device's memory."""
    s, cfg, device, prompts, rows, extra = build(preset, sampler, slots=slots, samples=samples, lo=lo, hi=hi,
                                                 max_new=max_new, pool_pages=pool_pages, token_budget=token_budget)
    kw = dict(n=samples, max_new_tokens=max_new, temperature=1.0, top_p=1.0, top_k=0)
    engine = sampler == "engine"
    warm_prompts, warm_kw = first_call(s, prompts, kw) if engine else (prompts, kw)
    progress(f"{sampler} built{' with ' + str(extra['pool_pages']) + ' pages' if 'pool_pages' in extra else ''}; "
             f"first call (compiles; {len(warm_prompts)} prompts x {samples}, {warm_kw['max_new_tokens']} new)")
    t0 = time.perf_counter()
    warm = s.sample(warm_prompts, key=jax.random.key(0), **warm_kw)  # compiles
    first = time.perf_counter() - t0
    progress(f"first call {first:.1f} s (prefill {warm.prefill_s:.1f} s, decode {warm.decode_s:.1f} s); timed call")
    extra["timed_call_compiles"] = []
    for _ in range(2):   # once more where the timed call compiled
        if engine:   # the prefix cache the last call filled: the timed call prefills every prompt
            s.invalidate()
        before_compiles, before_prefilled = compiles(), s.stats.prefilled_tokens if engine else 0
        t0 = time.perf_counter()
        res = s.sample(prompts, key=jax.random.key(1), **kw)
        wall = time.perf_counter() - t0
        extra["timed_call_compiles"].append(compiles() - before_compiles)
        extra["prefilled_tokens"] = (s.stats.prefilled_tokens - before_prefilled if engine
                                     else int(sum(len(p) for p in prompts)))
        if not extra["timed_call_compiles"][-1]:
            break
        progress(f"the timed call compiled {extra['timed_call_compiles'][-1]} program(s) in {wall:.1f} s; timed again")
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
            "ok": tokens == rows * max_new and res.decode_steps == max_new and not extra["timed_call_compiles"][-1]
            and extra["prefilled_tokens"] == sum(len(p) for p in prompts)}


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


# transformers' generate settings, fastest first (issue 41 asks for the fastest the image allows):
# a static cache, which generate compiles with torch.compile on CUDA (its CompileConfig defaults:
# inductor, "reduce-overhead" CUDA graphs; the prefill stays eager), else the default dynamic cache,
# eager, whose every step concatenates (copies) the whole cache
TORCH_SETTINGS = {"static": "static cache, torch.compile (generate's own: inductor, reduce-overhead)",
                  "dynamic": "dynamic cache, eager"}


def transformers_timing(preset: str, *, slots: int, samples: int, lo: int, hi: int, max_new: int,
                        prompts_per_call: int | None = None, settings: tuple = tuple(TORCH_SETTINGS)) -> dict:
    """transformers' `generate` (PyTorch, bf16, sdpa attention) on the same workload, in the
    fastest of `settings` that runs (TORCH_SETTINGS; the row names it and why any faster one
    did not): prompts left-padded to the workload's longest, `num_return_sequences=samples`,
    `prompts_per_call` prompts a call (device_check_shapes plans it from the device's memory;
    None: all in one; halved where a call runs out of memory). A warm-up call at the timed
    calls' shapes first (generate compiles there), then the timed calls. A logits processor
    reads the clock at a call's first and last step, synchronising the GPU only there:
    prefill = start -> first logits; decode = first -> last logits, max_new - 1 steps of
    every row; the calls' times are summed."""
    import torch
    import transformers

    from actionopd_jax.model import PRESETS

    cfg = PRESETS[preset]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                         if k not in ("architectures", "model_type", "torch_dtype", "dtype")})
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    t_built = time.perf_counter()
    with torch.device(dev):
        model = transformers.Qwen3ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    t_built = time.perf_counter() - t_built
    prompts, samples = workload(cfg.vocab_size, slots=slots, samples=samples, lo=lo, hi=hi)
    width = max(len(p) for p in prompts)    # every call padded alike: one compiled shape

    def batch(group):
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(group):   # left padding, as generate expects for a decoder-only model
            ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        return ids.to(dev), mask.to(dev)

    class Clock(transformers.LogitsProcessor):
        def __init__(self):
            self.times, self.steps = [], 0

        def __call__(self, input_ids, scores):
            self.steps += 1
            if self.steps in (1, max_new):      # no sync between: generate's own pace
                if dev == "cuda":
                    torch.cuda.synchronize()
                self.times.append(time.perf_counter())
            return scores

    def generate(group, setting: str) -> tuple[float, float, float, int]:
        """(prefill s, decode s, wall s, new tokens) of one call."""
        ids, mask = batch(group)
        clock = Clock()
        kw = dict(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                  max_new_tokens=max_new, min_new_tokens=max_new, num_return_sequences=samples, pad_token_id=0,
                  eos_token_id=None, logits_processor=transformers.LogitsProcessorList([clock]),
                  **({"cache_implementation": "static"} if setting == "static" else {}))
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(**kw)
            if dev == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        first, last = clock.times[0], clock.times[-1]
        return first - t0, last - first, wall, int(out.shape[1] - width)

    def out_of_memory(e: Exception) -> bool:
        return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()

    per = prompts_per_call or len(prompts)
    progress(f"transformers model built in {t_built:.1f} s ({model.config._attn_implementation} attention)")
    errors, chosen, warm_s = [], None, 0.0
    for setting in settings:
        while chosen is None:
            t_ready = time.perf_counter()
            progress(f"{TORCH_SETTINGS[setting]}: warm-up call of {min(per, len(prompts))} prompts x {samples}")
            try:
                generate(prompts[:per], setting)
                chosen, warm_s = setting, time.perf_counter() - t_ready
            except Exception as e:  # noqa: BLE001 - a setting this image cannot run: the next one, said in the row
                if dev == "cuda":
                    torch.cuda.empty_cache()
                if out_of_memory(e) and per > 1:
                    errors.append(f"{setting}: out of memory at {per} prompts a call; halved")
                    per //= 2
                    continue
                errors.append(f"{setting}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                break
        if chosen:
            break
    if chosen is None:
        raise RuntimeError("no transformers setting ran: " + "; ".join(errors))
    progress(f"warm-up {warm_s:.1f} s; timed calls ({-(-len(prompts) // per)} of {per} prompts)")
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    prefill_s = decode_s = wall = 0.0
    steps = []
    for i in range(0, len(prompts), per):
        p, d, w, n = generate(prompts[i:i + per], chosen)
        prefill_s, decode_s, wall, steps = prefill_s + p, decode_s + d, wall + w, steps + [n]
    rows = len(prompts) * samples
    decode_tokens = rows * (max_new - 1)
    return {"model": preset, "sampler": "transformers", "rows": rows, "prompts": len(prompts),
            "prompt_lens": [lo, hi], "prompt_tokens": int(sum(len(p) for p in prompts)), "max_new": max_new,
            "setting": TORCH_SETTINGS[chosen], "compiled": hasattr(model, "_compiled_call"),
            "attention": model.config._attn_implementation, "setting_errors": errors,
            "calls": len(steps), "prompts_per_call": per, "warm_up_s": round(warm_s, 2),
            "decode_steps": min(steps), "prefill_s": round(prefill_s, 6), "decode_s": round(decode_s, 6),
            "wall_s": round(wall, 4), "generated_tokens": rows * min(steps), "decode_tokens": decode_tokens,
            "tokens_per_s": round(decode_tokens / decode_s, 1), "end_to_end_tokens_per_s": round(rows * min(steps) / wall, 1),
            "peak_bytes": torch.cuda.max_memory_allocated() if dev == "cuda" else None,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            **step_bytes(cfg, prompts, samples, max_new), "ok": min(steps) == max(steps) == max_new}
