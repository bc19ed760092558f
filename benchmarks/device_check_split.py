"""Where the engine's time goes on the device (issue 41): one call of the decode workload under
jax's profiler, each of the engine's compiled programs (the prefill chunk, the decode segment)
with its ops summed by kind, as train/time_split.py splits the train step (issue 42).

Kinds, from the name scopes engine/programs.py puts on its ops (XLA keeps them in every
instruction's metadata), else from what the instruction is:
  attention             model/attention's scope: the paged kernel, prompt sharing's two passes
                        and merge, a fresh chunk's fused causal attention;
  KV writes             programs.KV_WRITE_SCOPE: each step's new keys and values into their pages;
  LM head and sampling  programs.HEAD_SCOPE: the vocabulary matmul and the token chooser;
  matmuls               the layers' weight matmuls (a dot, or a fusion holding one, or a GEMM call);
  collectives, other    (norms, rotary, residual adds, the page table's arithmetic).

On a GPU the programs are compiled with command buffers off (the profiler cannot attribute the
kernels XLA replays from CUDA graphs), so this call is not a timing: decode_timing's row is.
The decode time a step is the segment's op time over the steps it ran. Measured on the device
it ran on; nothing here is a compiler estimate.
"""

from __future__ import annotations

import gc
import re
import tempfile
import time

import jax

import device_check_decode as dec

KINDS = ("attention", "KV writes", "LM head and sampling", "matmuls", "collectives", "other")


def _scopes() -> dict[str, str]:
    from actionopd_jax.engine.programs import HEAD_SCOPE, KV_WRITE_SCOPE
    from actionopd_jax.model.attention.dispatch import SCOPE

    return {SCOPE: "attention", KV_WRITE_SCOPE: "KV writes", HEAD_SCOPE: "LM head and sampling"}


def engine_category(ins: dict, scopes: dict[str, str]) -> str | None:
    """The kind of one instruction of an engine program (module docstring); None: control flow."""
    from actionopd_jax.train.time_split import COLLECTIVES, CONTROL, scope_of

    op, target = ins["opcode"], ins["target"].lower()
    if op.removesuffix("-start").removesuffix("-done") in COLLECTIVES:
        return "collectives"
    if op in CONTROL:
        return None
    scope = scope_of(ins["op_name"], scopes)
    if scope:
        return scope
    if "fmha" in target:
        return "attention"
    if op in ("dot", "convolution") or ins["has_dot"] or any(t in target for t in ("gemm", "cublas", "matmul")):
        return "matmuls"
    return "other"


def split_programs(events: list[dict], programs: dict) -> dict:
    """{program kind: split_events of its ops} for the engine's compiled programs ({kind:
    compiled}); programs sharing an HLO module name (the CPU's row-count segments) are split
    once, by the first."""
    from actionopd_jax.train.time_split import split_events

    scopes, out, seen = _scopes(), {}, set()
    for kind, program in programs.items():
        text = program.as_text()
        module = re.search(r"HloModule\s+([\w.\-]+)", text)
        module = module.group(1) if module else kind
        if module in seen:
            continue
        seen.add(module)
        out[kind] = split_events(events, text, 1, categorize=lambda ins: engine_category(ins, scopes),
                                 categories=KINDS, scopes=scopes)
    return out


def engine_split(preset: str, *, slots: int, samples: int, lo: int, hi: int, max_new: int,
                 pool_pages: int | None = None) -> dict:
    """The engine on decode_timing's workload (`max_new` new tokens: a short run keeps the trace
    small; every prompt is prefilled), compiled with command buffers off on a GPU, its first
    call on its WARM_PROMPTS longest prompts, then one call of the whole workload, its prefix
    cache dropped first, under the profiler."""
    from actionopd_jax.train.time_split import NO_COMMAND_BUFFERS, events_in

    gpu = jax.local_devices()[0].platform == "gpu"
    shape = dict(slots=slots, samples=samples, lo=lo, hi=hi, max_new=max_new, pool_pages=pool_pages)
    buffers = "off" if gpu else "n/a"
    try:   # building compiles the programs against the pool (device_check_decode.pool_check)
        s, cfg, device, prompts, rows, extra = dec.build(preset, "engine", **shape,
                                                         options=NO_COMMAND_BUFFERS if gpu else None)
    except Exception as e:  # noqa: BLE001 - a jax that refuses the option: profile as it runs
        if not gpu:
            raise
        buffers = f"on (turning them off failed: {str(e).splitlines()[0][:120] if str(e) else e!r})"
        gc.collect()
        s, cfg, device, prompts, rows, extra = dec.build(preset, "engine", **shape)
    kw = dict(n=samples, max_new_tokens=max_new, temperature=1.0, top_p=1.0, top_k=0)
    dec.progress(f"engine built with {extra['pool_pages']} pages, command buffers {buffers}; first call (compiles)")
    warm_prompts, warm_kw = dec.first_call(s, prompts, kw)
    s.sample(warm_prompts, key=jax.random.key(0), **warm_kw)
    s.invalidate()
    dec.progress("profiled call")
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        try:
            t0 = time.perf_counter()
            res = s.sample(prompts, key=jax.random.key(1), **kw)
            wall = time.perf_counter() - t0
        finally:
            jax.profiler.stop_trace()
        dec.progress(f"profiled call {wall:.1f} s; reading the trace")
        events = events_in(trace_dir)
    held = {kind: program for kind, (_, program) in s.programs._local.items()}
    programs = split_programs(events, held)
    return {"model": preset, "sampler": "engine", "rows": rows, "prompts": len(prompts),
            "prompt_tokens": int(sum(len(p) for p in prompts)), "max_new": max_new,
            "decode_steps": res.decode_steps, "prefill_s": round(res.prefill_s, 6), "decode_s": round(res.decode_s, 6),
            "profiled_s": round(wall, 4), "command_buffers": buffers, "programs": programs,
            "pool_pages": extra["pool_pages"], "ok": bool(programs) and all(p["ops"] for p in programs.values())}


__all__ = ["KINDS", "engine_category", "engine_split", "split_programs"]
