"""The device check's programs compiled for a lent GPU kind on this host, without the GPU.

XLA's deviceless GPU compiler (actionopd_jax/aot/gpu_topology.py) compiles each program the
device check will run on an H100 or H200, at the shapes device_check_shapes plans for that
kind's memory, and reads XLA's memory analysis of it. Compiler estimates, not device figures:
they say before a visit whether a stage will run out of memory, and whether the plan that
chose its shapes is right. Anchor: run 1's one clean train peak (H200, 4B, 4,096 tokens, full
remat, 66,435,741,440 bytes) is what this compile gives (tests/test_gpu_deviceless.py).

  PYTHONPATH=. python benchmarks/gpu_aot.py --kind h100 [--out FILE.json] [--only train|engine]

- train: Qwen3-4B's update (one 1-row microbatch, cuDNN attention) under each remat policy
  at the device check's two lengths: XLA's peak beside `train --check`'s plan, and the policy
  `model.remat: auto` picks by the plan and by the compile (train/remat_confirm.py's rule);
- engine: the engine's prefill chunk, fresh-prompt chunk and decode segment at each decode
  workload's shapes (device_check_decode.build's: rows = slots, chunk = the longest prompt,
  pages of 16, the planned pool): what each needs beside its arguments, and the pool plus the
  weights plus the largest need against the usable memory (engine/pool_fit.py's test, which
  the device check's `pool_check` applies on the device);
- static: the static sampler's prefill and decode at each workload's planned call.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")   # no driver here: let the plugin register
sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 2 ** 30
POLICIES = ("none", "dots", "full")


def _gib(x: float) -> float:
    return round(x / GIB, 2)


def train_rows(kind: str, usable: float, lengths: tuple[int, ...]) -> list[dict]:
    import device_check_shapes as shapes
    import device_check_work as work

    from actionopd_jax.aot.targets import target_devices
    from actionopd_jax.model import make_mesh
    from actionopd_jax.train.aot_check import update_memory
    from actionopd_jax.train.plan import estimate_memory
    from actionopd_jax.train.setup import model_config

    preset, _, _, resp = shapes.TRAIN["device"]
    mesh = make_mesh({"fsdp": 1}, devices=target_devices(f"{kind}x1")[:1])
    rows = []
    for seq in lengths:
        found = []
        for policy in POLICIES:
            cfg = work.train_config(preset, "cudnn", 1, seq, resp, policy, None)
            qcfg = model_config(cfg)
            plan = estimate_memory(cfg, qcfg, {"data": 1, "fsdp": 1, "tensor": 1}, "cudnn").total
            t0 = time.perf_counter()
            report = update_memory(cfg, qcfg, mesh)
            found.append({"section": "train", "seq": seq, "remat": policy, "ok": report.ok, "error": report.error,
                          "compiled_gib": _gib(report.peak_bytes), "plan_gib": _gib(plan),
                          "plan_over_compiled": round(plan / report.peak_bytes, 3) if report.ok else None,
                          "compile_s": round(time.perf_counter() - t0, 1)})
        by_plan = next((r["remat"] for r in found if r["plan_gib"] * GIB <= usable), None)
        start = POLICIES.index(by_plan) if by_plan else len(POLICIES)
        by_compile = next((r["remat"] for r in found[start:] if r["ok"] and r["compiled_gib"] * GIB <= usable), None)
        for r in found:
            r.update(auto_by_plan=by_plan, auto_confirmed=by_compile)
        rows += found
    return rows


@functools.cache
def _decode_setup(kind: str):
    """(device_check_shapes' plan for this kind's memory, a one-GPU mesh of it): the engine's
    and the static sampler's sections share them."""
    import device_check_shapes as shapes

    from actionopd_jax.aot.gpu_topology import HOPPER
    from actionopd_jax.aot.targets import target_devices
    from actionopd_jax.model import make_mesh

    plan = shapes.choose("device", "gpu", HOPPER[kind].memory_bytes, source=f"{kind} facts")
    return plan, make_mesh({"tensor": 1}, devices=target_devices(f"{kind}x1")[:1])


def engine_rows(kind: str, usable: float) -> list[dict]:
    import device_check_shapes as shapes

    from actionopd_jax.engine.aot import compile_engine_programs
    from actionopd_jax.engine.pool_fit import ProgramNeeds
    from actionopd_jax.engine.sizing import EngineConfig
    from actionopd_jax.model import PRESETS, count_params
    from actionopd_jax.model.runtime import RuntimeOptions
    from actionopd_jax.sampling.budget import cache_bytes_per_token

    plan, mesh = _decode_setup(kind)
    rows = []
    for work, spec in shapes.DECODE["device"].items():
        preset, slots, samples, lo, hi, new = spec
        pages = plan["decode"][work]["pool_pages"]
        cfg = PRESETS[preset]
        config = EngineConfig(slots=slots, page_size=shapes.PAGE_SIZE, max_len=hi + new, chunk=hi, segment=16,
                              pages=pages)
        t0 = time.perf_counter()
        # bf16 compute, as device_check_decode.build runs it (float32 would take the xla attention)
        reports = compile_engine_programs(cfg, mesh, config, attention="auto", label=f"{work}",
                                          runtime=RuntimeOptions(dtype="bfloat16"))
        weights = 2 * count_params(cfg)["total"]
        pool = pages * shapes.PAGE_SIZE * cache_bytes_per_token(cfg, "bfloat16")
        # what each needs beside its arguments, as engine/pool_fit.py counts it
        beside = [ProgramNeeds(r.label, r.argument_bytes, r.output_bytes, r.alias_bytes, r.temp_bytes,
                               r.code_bytes).beside_arguments for r in reports if r.ok]
        rows.append({"section": "engine", "work": work, "preset": preset, "slots": slots, "pool_pages": pages,
                     "weights_gib": _gib(weights), "pool_gib": _gib(pool),
                     "programs": {r.label.split(" (")[0]: ({"temp_gib": _gib(r.temp_bytes), "args_gib": _gib(r.argument_bytes),
                                                           "out_not_aliased_gib": _gib(max(0.0, r.output_bytes - r.alias_bytes))}
                                                          if r.ok else {"error": r.error}) for r in reports},
                     "total_gib": _gib(weights + pool + max(beside, default=0)), "usable_gib": _gib(usable),
                     "ok": all(r.ok for r in reports) and weights + pool + max(beside, default=0) <= usable,
                     "compile_s": round(time.perf_counter() - t0, 1)})
    return rows


def static_rows(kind: str, usable: float) -> list[dict]:
    """The static sampler's prefill and decode at each decode workload's planned call (its
    prompts a call: device_check_shapes splits the workload where one call does not fit)."""
    import math

    import device_check_shapes as shapes

    from actionopd_jax.model import PRESETS
    from actionopd_jax.model.runtime import RuntimeOptions
    from actionopd_jax.sampling.aot import compile_sampler_programs, memory_gib
    from actionopd_jax.sampling.buckets import Buckets

    plan, mesh = _decode_setup(kind)
    rows = []
    for work, spec in shapes.DECODE["device"].items():
        preset, slots, samples, lo, hi, new = spec
        prompts = math.ceil(slots // samples / plan["decode"][work]["static_calls"])
        t0 = time.perf_counter()
        try:
            programs = compile_sampler_programs(PRESETS[preset].replace(param_dtype="bfloat16"), mesh, prompts=prompts,
                                                prompt_len=Buckets.fit(hi, Buckets().prompt_len, "prompt_len"),
                                                samples=samples, max_new=new, runtime=RuntimeOptions(dtype="bfloat16"))
        except Exception as e:  # noqa: BLE001 - the compiler's verdict is the row
            rows.append({"section": "static", "work": work, "prompts_a_call": prompts, "ok": False,
                         "error": str(e).splitlines()[0][:200]})
            continue
        found = {"prefill": memory_gib(programs.prefill), "decode": memory_gib(programs.decode)}
        peak = max(m["peak"] for m in found.values())
        rows.append({"section": "static", "work": work, "preset": preset, "prompts_a_call": prompts,
                     "calls": plan["decode"][work]["static_calls"],
                     "programs": {k: {n: round(v, 2) for n, v in m.items()} for k, m in found.items()},
                     "peak_gib": round(peak, 2), "usable_gib": _gib(usable), "ok": peak * GIB <= usable,
                     "compile_s": round(time.perf_counter() - t0, 1)})
    return rows


TRAIN_HEAD = "train: tokens | remat | compiled GiB | plan GiB | plan / compiled | auto by plan -> confirmed"
ENGINE_HEAD = "engine: work | pool pages | weights + pool + largest need GiB | usable | fits | temps by program"
STATIC_HEAD = "static: work | prompts a call (calls) | peak GiB (prefill, decode) | usable | fits"


def _train_line(r: dict) -> str:
    return (f"{r['seq']:>6,} | {r['remat']:<4} | {r['compiled_gib'] if r['ok'] else r['error'][:60]} | "
            f"{r['plan_gib']} | {r['plan_over_compiled']} | {r['auto_by_plan']} -> {r['auto_confirmed']}")


def _engine_line(r: dict) -> str:
    temps = ", ".join(f"{k.removeprefix('engine ')} {v.get('temp_gib', v.get('error', '')[:60])}"
                      for k, v in r["programs"].items())
    return (f"{r['work']} ({r['preset']}, {r['slots']} rows) | {r['pool_pages']:,} | {r['total_gib']} | "
            f"{r['usable_gib']} | {'yes' if r['ok'] else 'NO'} | {temps}")


def _static_line(r: dict) -> str:
    if "programs" not in r:
        return f"{r['work']} | {r['prompts_a_call']} | ERROR {r['error'][:100]}"
    return (f"{r['work']} ({r['preset']}) | {r['prompts_a_call']} ({r['calls']}) | {r['peak_gib']} "
            f"({r['programs']['prefill']['peak']}, {r['programs']['decode']['peak']}) | {r['usable_gib']} | "
            f"{'yes' if r['ok'] else 'NO'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("h100", "h200"), default="h100")
    p.add_argument("--only", choices=("train", "engine", "static"), default="")
    p.add_argument("--lengths", default="4096,16384")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION, quiet_libtpu_without_chips

    quiet_libtpu_without_chips()
    from actionopd_jax.aot.gpu_topology import HOPPER

    usable = USABLE_MEMORY_FRACTION * HOPPER[args.kind].memory_bytes
    print(f"{HOPPER[args.kind].description}: usable {usable / GIB:.1f} GiB ({USABLE_MEMORY_FRACTION:.0%}); "
          f"XLA's deviceless GPU compile, compiler estimates")
    lengths = tuple(int(n) for n in args.lengths.split(","))
    sections = {"train": (lambda: train_rows(args.kind, usable, lengths), TRAIN_HEAD, _train_line),
                "engine": (lambda: engine_rows(args.kind, usable), ENGINE_HEAD, _engine_line),
                "static": (lambda: static_rows(args.kind, usable), STATIC_HEAD, _static_line)}
    rows = []
    for name, (compile_rows, head, line) in sections.items():
        if args.only in ("", name):
            found = compile_rows()
            rows += found
            print(head)
            for r in found:
                print(f"  {line(r)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"kind": args.kind, "usable_gib": _gib(usable), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
