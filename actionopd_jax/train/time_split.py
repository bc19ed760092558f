"""Where one train step's time goes: a profile of the compiled update, its ops summed by kind.

    profile_update(step, state, batch) -> {"categories": {kind: s per step}, "top": ..., ...}

The update runs under jax's profiler; every op event the trace holds (device kernels on a GPU,
the thunk executor's ops on CPU) names its HLO instruction (`hlo_op`), and the compiled
program's HLO text says what each instruction is. An op's kind comes from, in this order:
- collectives by opcode (all-reduce, all-gather, reduce-scatter, ...);
- the name scopes the code puts around attention (model/attention/dispatch.SCOPE), the LM
  head (train/head_logprobs.SCOPE) and the AdamW update (train/step.OPTIMIZER_SCOPE), which
  XLA keeps in every instruction's metadata, backward passes included (their op names hold
  "transpose(": under remat the recomputed forward counts as backward too);
- cuDNN's fused attention and cuBLAS's GEMMs by custom-call target;
- matmuls: a dot, or a fusion whose computation holds one;
- everything else ("other": norms, rotary, residual adds, casts, copies, the loss).

On a GPU, XLA replays most kernels from CUDA graphs ("command buffers"), whose kernels the
profiler cannot attribute to instructions, so the profiled program is compiled with command
buffers off (its time per step is reported beside the timed one's, so the difference shows).
The split is measured, on the device it ran on; nothing here is a compiler estimate.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile
import time
from collections import defaultdict

import jax

from actionopd_jax.aot.hlo_text import computation_header, instruction

CATEGORIES = ("attention forward", "attention backward", "matmuls forward", "matmuls backward", "LM head",
              "optimizer", "collectives", "other")
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all", "collective-broadcast")
CONTROL = ("while", "conditional", "call", "tuple", "get-tuple-element", "parameter", "constant", "bitcast")
_SCOPES = {"attention": "attention", "lm_head": "LM head", "lm_head_bwd": "LM head", "optimizer": "optimizer"}

_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def parse_hlo(text: str) -> dict[str, dict]:
    """Instruction name -> {opcode, op_name, target, calls, has_dot (the computation it calls
    holds a dot or convolution)} for every instruction of an HLO module's text."""
    instrs, dots, comp = {}, set(), None
    for line in text.splitlines():
        header = computation_header(line)
        if header:
            comp = header[0]
            continue
        parsed = instruction(line) if comp is not None else None
        if parsed is None:
            continue
        name, _, op, rest = parsed
        if op in ("dot", "convolution"):
            dots.add(comp)
        op_name, target, calls = _OP_NAME.search(rest), _TARGET.search(rest), _CALLS.search(rest)
        instrs[name] = {"opcode": op, "op_name": op_name.group(1) if op_name else "",
                        "target": target.group(1) if target else "", "calls": calls.group(1) if calls else ""}
    for ins in instrs.values():
        ins["has_dot"] = ins["calls"] in dots
    return instrs


def scope_of(op_name: str, scopes: dict[str, str] = _SCOPES) -> str | None:
    """The kind `scopes` gives the first of the op's name scopes it names."""
    for part in re.split(r"[/()]", op_name):
        if part in scopes:
            return scopes[part]
    return None


def category(ins: dict) -> str | None:
    """The kind of one instruction (module docstring); None: control flow, not timed itself."""
    op, name, target = ins["opcode"], ins["op_name"], ins["target"].lower()
    base = op.removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVES:
        return "collectives"
    if op in CONTROL:
        return None
    backward = "transpose(" in name
    scope = scope_of(name)
    if scope == "attention" or "fmha" in target:
        return "attention backward" if backward or "backward" in target else "attention forward"
    if scope:
        return scope
    if op in ("dot", "convolution") or ins["has_dot"] or any(t in target for t in ("gemm", "cublas", "matmul")):
        return "matmuls backward" if backward else "matmuls forward"
    return "other"


def events_in(trace_dir: str) -> list[dict]:
    """The trace events jax's profiler wrote under `trace_dir` (its newest trace)."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)) or \
        sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not paths:
        return []
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def split_events(events: list[dict], hlo_text: str, steps: int = 1, *, categorize=category,
                 categories: tuple[str, ...] = CATEGORIES, scopes: dict[str, str] = _SCOPES) -> dict:
    """Seconds per step by kind, from trace events of `steps` runs of the program `hlo_text`.
    Device tracks ("/device:...") where the trace has them, else the host's (CPU backend).
    `categorize(instruction) -> kind | None` over `categories`, whose name `scopes` are counted
    (the update's by default; the engine's programs have their own, benchmarks/device_check_split.py)."""
    module = re.search(r"HloModule\s+([\w.\-]+)", hlo_text)
    module = module.group(1) if module else ""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, n in names.items() if n.startswith("/device:")}
    instrs = parse_hlo(hlo_text)
    per_op, unknown = defaultdict(float), 0
    for e in events:
        args = e.get("args") or {}
        op = args.get("hlo_op")
        if e.get("ph") != "X" or not op or (device and e.get("pid") not in device):
            continue
        if module and args.get("hlo_module", module) != module:
            continue
        if op not in instrs:
            unknown += 1
            continue
        per_op[op] += float(e.get("dur", 0.0)) * 1e-6 / steps
    totals = dict.fromkeys(categories, 0.0)
    top = []
    for op, s in per_op.items():
        kind = categorize(instrs[op])
        if kind is None:
            continue
        totals[kind] += s
        top.append((s, op, kind))
    top.sort(reverse=True)
    scoped = sum(scope_of(ins["op_name"], scopes) is not None for ins in instrs.values())
    return {"categories": {k: round(v, 6) for k, v in totals.items()}, "ops_s": round(sum(totals.values()), 6),
            "ops": len(per_op), "unmatched_events": unknown, "scoped_instructions": scoped,
            "tracks": "device" if device else "host",
            "top": [{"op": op, "kind": kind, "s": round(s, 6)} for s, op, kind in top[:8]]}


def profile_update(step, state, batch, *, steps: int = 1) -> tuple[dict, dict]:
    """Compile `step`'s update again (command buffers off on GPU), run it once, then `steps`
    times under the profiler. Returns (the split, the state after: `state` is donated)."""
    from actionopd_jax.jax_compat import set_mesh

    platform = jax.devices()[0].platform
    buffers = "n/a"
    with set_mesh(step.mesh):
        lowered = step._update.lower(state, batch)
        if platform == "gpu":
            try:
                compiled, buffers = lowered.compile(compiler_options=NO_COMMAND_BUFFERS), "off"
            except Exception as e:  # noqa: BLE001 - a jax that refuses the option: profile as it runs
                compiled = lowered.compile()
                buffers = f"on (turning them off was refused: {str(e).splitlines()[0][:120] if str(e) else e!r})"
        else:
            compiled = lowered.compile()
        state, m = compiled(state, batch)
        float(m["loss"])
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
            try:
                t0 = time.perf_counter()
                for _ in range(steps):
                    state, m = compiled(state, batch)
                float(m["loss"])
                wall = (time.perf_counter() - t0) / steps
            finally:
                jax.profiler.stop_trace()
            out = split_events(events_in(trace_dir), compiled.as_text(), steps)
    out["profiled_step_s"] = float(f"{wall:.6g}")
    out["command_buffers"] = buffers
    if not out["ops"]:
        out["note"] = "the trace held no op events of this program (no per-op profile on this host)"
    elif not out["scoped_instructions"]:
        # jax's persistent-cache key leaves op names out, so an executable compiled by code
        # without the scopes can be served for code with them
        out["note"] = ("no instruction carries the code's name scopes: the program came from a persistent "
                       "compile cache written by older code; clear that cache for a split by kind")
    return out, state


__all__ = ["CATEGORIES", "COLLECTIVES", "CONTROL", "NO_COMMAND_BUFFERS", "category", "events_in", "parse_hlo",
           "profile_update", "scope_of", "split_events"]
