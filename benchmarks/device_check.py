"""The first command to run on new hardware: one NVIDIA GPU host or one TPU VM, as that machine
is (nothing installed: the repository on PYTHONPATH and the jax already there).

    PYTHONPATH=. python benchmarks/device_check.py [--out DIR] [--budget-s 420] [--only NAME,...]
    python benchmarks/device_check.py --out DIR --dry-run      # any CPU host: the same steps, tiny shapes

1. Finds the accelerator (`nvidia-smi` -> gpu, /dev/accel* or /dev/vfio -> tpu). Installs nothing
   when jax already sees it (or with --no-install); else `pip install -e '.[cuda]'` / `'.[tpu]'`.
2. Runs the measurements in child interpreters (this process never starts jax, so it never
   holds the device), in order of value, each with a time limit (--stage-timeout-s overrides);
   none starts with less than half its limit left of --budget-s, and the budget's end cuts one
   running (both go on the rerun list). One over its own limit is killed with its process,
   recorded as timed out, and the rest go on in a fresh child. Every finished row is written
   at once, so a call cut short keeps its rows. The children share a persistent compilation
   cache (--compile-cache; device_check_host.CACHE_DIR), so a rerun loads what was compiled.
   1. the ceilings: memory bandwidth (a copy) and a bf16 matmul, which every ratio is taken against;
   2. decode at Qwen3-4B shapes, 256 slots, prompts of 1,024-4,096 tokens, 256 new tokens:
      the engine, then the static sampler, against the HBM bound; then the same at 64 slots;
   3. transformers' `generate` on the 64-slot workload, in its fastest setting that runs (named);
   4. greedy tokens of the tiny model, static sampler and engine, float32, equal to the CPU's;
   5. the train step at Qwen3-4B shapes (random weights) under the remat `model.remat=auto`
      picks for this device's memory (the recipe's where that is full), once more under the
      profiler, its time split by kind (train/time_split.py): compile s, step s, tokens/s,
      MFU, peak memory against `train --check`'s plan;
   6. the engine's time split at 256 slots, 32 new tokens (device_check_split.py); issue 41's
      attention candidates on one layer (device_check_kernels.py); on a GPU, step 5's step
      with its layers unrolled; `generate` on the 256-slot workload; decode at Qwen3-0.6B
      shapes, 256 slots; on a GPU, step 5's step under each XLA flag candidate
      (device_check_shapes.TRAIN_XLA_FLAGS), each in a process of its own;
   7. attention parity: the platform's fused kernel (cudnn / splash) against "xla", forward
      and the gradients of q, k, v, bf16, right-padded rows; the other train steps, as the
      H200 recipe sets remat: fused kernel then xla at 4,096 tokens, the fused one at 16,384.
   The shapes fit the device: device_check_shapes.py plans them from the GPU's memory
   (nvidia-smi; --memory-gib overrides) with the project's plans; the report names the figure.
3. Writes DIR/device_check.json and DIR/device_check.md (docs/formats.md, "Device check
   report"), DIR defaulting to $OUT; prints the short table last; exit 0 when every check
   passed. What the budget left unstarted is listed with the `--only` argument that runs it.

--dry-run runs every step on this host's CPU at tiny shapes (no install), so CI proves the
script end to end; tests/test_device_check.py runs it with only the device's packages.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the modules beside this file (on sys.path when run as a script; not when loaded by path, as the tests do)
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
from device_check_host import (cache_dir, describe, detect_platform, install,  # noqa: E402 - after the path above
                               start_cache)
from device_check_report import apply_ceilings, markdown  # noqa: E402
from device_check_shapes import DECODE, TRAIN_UNROLLED, TRAIN_XLA_FLAGS, choose, gpu_memory_bytes, only  # noqa: E402

STARTUP_LIMIT_S = 180.0  # the child's jax import and device start, before its first measurement
EVENTS = "device_check_events.jsonl"
SECTIONS = ("ceilings", "parity", "train_step", "decode", "decode_split", "attention_kernels")

def stages(mode: str, platform: str, shapes: dict | None = None) -> list[tuple[str, str, float, dict]]:
    """(name, report section, time limit s, call) of every measurement, in the order they run:
    the issue's order of value, so a budget that runs out trims the least valuable. `shapes`:
    device_check_shapes.choose's plan for the device's memory (None: the default shapes);
    what it left out (no variant fits) is not run."""
    dev = mode == "device"
    shapes = shapes or choose(mode, platform, None)
    preset, resp = shapes["preset"], shapes["resp"]
    dropped = {d["stage"] for d in shapes["dropped"]}
    def decode(work):
        wp, slots, *_ = DECODE[mode][work]
        # 130 s: GPU decode programs unroll their layers (decode.layer_unroll_for), ~2.7x the compile
        return [(f"decode {wp} {sampler} {slots}", "decode", 130.0 if dev else 60.0,
                 {"fn": "decode", "sampler": sampler, "work": work, "own": dev,
                  "pool_pages": shapes["decode"][work]["pool_pages"] if sampler == "engine" else None,
                  "token_budget": shapes["decode"][work]["static_token_budget"] if sampler == "static" else None})
                for sampler in ("engine", "static") if f"decode {wp} {sampler} {slots}" not in dropped]

    def generate(work):
        # torch: in its own process, after the jax one has exited (jax holds its share of the GPU
        # until then, and torch needs the rest); the limit leaves room for generate's compile
        wp, slots, *_ = DECODE[mode][work]
        return (f"generate {wp} transformers {slots}", "decode", 180.0 if dev else 60.0,
                {"fn": "transformers", "work": work, "own": True, "torch": True,
                 "prompts_per_call": shapes["decode"][work].get("torch_prompts_per_call")})

    train = []
    for i, t in enumerate(shapes["train"]):
        # named by its master weights where they are not the recipe's (float32): another step's plan
        suffix = (f" {t['param_dtype']} weights" if t["param_dtype"] else "") + \
            (f" remat {t['remat']}" if t.get("remat") else "")
        train.append((f"train {preset} {t['attention']} {t['seq']}{suffix}", "train_step", 150.0 if dev else 60.0,
                      {"fn": "train", "preset": preset, "attention": t["attention"], "seq": t["seq"], "resp": resp,
                       "param_dtype": t["param_dtype"], "remat": t.get("remat"), "own": dev,
                       "split": i == 0}))     # the first (most valuable) step also runs under the profiler
    wp, slots, *_ = DECODE[mode]["big"]     # issue 41's diagnosis at 256 rows: the engine's split, the kernels
    split = [] if f"decode {wp} engine {slots}" in dropped else [
        (f"split decode {wp} engine {slots}", "decode_split", 120.0 if dev else 60.0,
         {"fn": "split", "work": "big", "own": dev, "pool_pages": shapes["decode"]["big"]["pool_pages"]})]
    split += [(f"kernels {wp} {slots}", "attention_kernels", 90.0 if dev else 60.0, {"fn": "kernels", "work": "big", "own": dev})
              ] if platform == "gpu" or not dev else []       # the candidates are GPU kernels
    def variants(labelled: dict, own: bool, limit=None) -> list:   # 42's candidates on step 1 (GPU; dry run: the path)
        return [(f"{name} {label}", sec, limit or lim, {**spec, "split": False, "own": own, **extra}) for label, extra
                in labelled.items() for name, sec, lim, spec in train[:1] if platform == "gpu" or not dev]
    unrolled = variants(TRAIN_UNROLLED, dev, 210.0 if dev else None)   # a compile of ~60 s, twice if the cache misses
    flagged = variants({f"flags {k}": {"xla_flags": v} for k, v in TRAIN_XLA_FLAGS.items()}, True)   # flags read once
    # the order of value: issue 41's 4B decodes at 256 and 64 rows, generate at 64, token parity;
    # 42's first train step (remat by memory, with its split); 41's diagnosis (the engine's split,
    # the kernels); 42's unrolled layers; the rest of 41 (generate at 256, the 0.6B decodes), the
    # flag candidates, the kernels' parity and the other train steps (the recipe's, run 1's)
    return ([("ceilings", "ceilings", 60.0, {"fn": "ceilings"})] + decode("big") + decode("small") +
            [generate("small"), ("sampler parity", "parity", 90.0, {"fn": "sampler parity"})] + train[:1] + split +
            unrolled + [generate("big")] + decode("0.6b") + flagged + [("attention parity", "parity", 60.0, {"fn": "attention"})]
            + train[1:])


def child(mode: str, names: list[str], out_dir: Path, memory: int | None = None, source: str = "",
          cache: str = "off") -> int:
    """`--stage work`: run the named measurements here, one event line each (start, done) appended
    to DIR/device_check_events.jsonl for the parent to follow; `memory` (bytes, from `source`):
    the figure the parent planned for; `cache`: the children's compilation cache (or "off")."""
    if mode == "dry-run":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION

    shapes = choose(mode, detect_platform(), memory, source)
    specs = {name: spec for name, _, _, spec in stages(mode, detect_platform(), shapes)}
    flags = [specs[n]["xla_flags"] for n in names if specs.get(n, {}).get("xla_flags")]
    if flags:  # a flagged measurement runs alone ("own"): its flags are this process's, read at jax's start
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
    if all(specs.get(n, {}).get("torch") for n in names):
        # torch's own measurement: jax only names the device, and must not take its memory
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    else:
        # the share of device memory XLA may take, as `actionopd train` sets it: the train
        # step's peak is then held to the same limit as `train --check`'s plan
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{USABLE_MEMORY_FRACTION:.2f}")
    import traceback

    import jax

    import device_check_decode as dec
    import device_check_kernels as kn
    import device_check_split as sp
    import device_check_work as w

    log = open(out_dir / EVENTS, "a")
    cached = start_cache(cache)

    def emit(**event):
        log.write(json.dumps(event) + "\n")
        log.flush()

    # a dry run on one CPU device whatever the host has (the smallest programs to compile)
    devices = jax.local_devices() if mode == "device" else jax.local_devices()[:1]
    platform = devices[0].platform if mode == "device" else "cpu"
    emit(event="devices", platform=platform, jax=jax.__version__, devices=[describe(d) for d in devices])
    dev = mode == "device"
    calls = {name: spec for name, _, _, spec in stages(mode, platform, shapes)}

    def call(spec):
        fn = spec["fn"]
        if fn == "ceilings":
            # a dry run checks the stage runs and reports, not the CPU's speed: 8 MiB / n=128 take
            # seconds where 64 MiB / n=512 took ~20-40 s (the tests compile at -O0, under load)
            return w.ceilings(devices[0], copy_mib=2048 if dev else 8, matmul_n=8192 if dev else 128)
        if fn == "attention":
            shape = dict(batch=2, seq=2048, kv_heads=8, groups=4, head_dim=128) if dev else \
                dict(batch=2, seq=64, kv_heads=2, groups=2, head_dim=16)
            return w.attention_parity(platform, **shape)
        if fn == "train":
            return w.train_step_timing(spec["preset"], spec["attention"], rows=len(devices), seq=spec["seq"],
                                       resp=spec["resp"], reps=2 if dev else 1, devices=devices,
                                       param_dtype=spec["param_dtype"], remat=spec.get("remat"),
                                       split=spec.get("split", False), scan_unroll=spec.get("scan_unroll"))
        if fn == "sampler parity":
            return w.sampler_parity(devices[0], bf16=dev)
        preset, slots, samples, lo, hi, new = DECODE[mode][spec["work"]]
        if fn == "kernels":   # issue 41's attention candidates on one layer of the 256-row workload
            return kn.kernel_stage(mode, preset, slots=slots, lo=lo, hi=hi)
        if fn == "split":   # a short run: the trace of 32 steps says enough, and reads in seconds
            return sp.engine_split(preset, slots=slots, samples=samples, lo=lo, hi=hi, max_new=min(new, 32),
                                   pool_pages=spec["pool_pages"])
        if fn == "decode":
            return dec.decode_timing(preset, slots=slots, samples=samples, lo=lo, hi=hi, max_new=new,
                                     sampler=spec["sampler"], pool_pages=spec["pool_pages"],
                                     token_budget=spec["token_budget"])
        return dec.transformers_timing(preset, slots=slots, samples=samples, lo=lo, hi=hi, max_new=new,
                                       prompts_per_call=spec["prompts_per_call"])

    def note(what: str) -> None:
        print(f"[device_check]   {what}", file=sys.stderr, flush=True)
        emit(event="progress", name=current[0], what=what)

    current = [""]
    dec.progress = note
    for name in names:
        current[0] = name
        emit(event="start", name=name)
        print(f"[device_check] {name}: start (jax {jax.__version__}, {devices[0].device_kind})", flush=True)
        t0, before = time.time(), cached()
        try:
            res = call(calls[name])
        except Exception as e:  # noqa: BLE001 - a failed measurement is a result
            tb = traceback.format_exc().replace(str(ROOT) + "/", "")   # paths relative to the checkout
            print(tb, file=sys.stderr, flush=True)  # the exact failure, in the call's output
            res = {"check": name, "ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                   if str(e) else type(e).__name__, "jax": jax.__version__, "traceback": tb.splitlines()[-25:]}
        rows = res if isinstance(res, list) else [res]
        after = cached()   # the measurement's programs loaded from the cache and compiled (a rerun loads)
        for r in rows:
            r.setdefault("stage", name)
            if cache != "off":
                r["compile_cache"] = {k: after[k] - before[k] for k in after}
            if calls[name].get("xla_flags"):
                r["xla_flags"] = calls[name]["xla_flags"]
        emit(event="done", name=name, result=rows, seconds=round(time.time() - t0, 1))
        gc.collect()    # a failed stage's frames (and what they hold on the device) are cycles
    return 0


def budget_cut(began: float, limit: float, deadline: float) -> bool:
    """Whether a measurement started at `began` and killed is the budget's cut (the deadline
    came before its own time limit) rather than over its limit."""
    return deadline < began + limit


def run_stages(mode: str, platform: str, out_dir: Path, plan, deadline: float, stage_timeout: float | None,
               on_record=lambda out: None, shapes: dict | None = None, cache: str = "off") -> dict:
    """Every measurement of `plan` in child interpreters, each killed at its time limit or at
    `deadline`; what the deadline leaves unstarted or cuts is listed under "skipped" (the rerun
    list), a measurement with less than half its limit left passed over. `on_record(out)`
    runs after each measurement (the caller writes the report there); `shapes`: the memory
    figure the plan was chosen for, passed on to each child, as `cache` (a directory or "off")."""
    out = {"platform": platform, "jax": "", "devices": [], **{sec: [] for sec in SECTIONS},
           "skipped": [], "timed_out": [], "errors": [], "stage_s": {}}
    section = {name: sec for name, sec, _, _ in plan}
    limit = {name: stage_timeout or lim for name, _, lim, _ in plan}
    # "own": a process of its own (on a device: each train step and decode, so its peak memory
    # is its own and a pool it leaves behind cannot starve the next; run 1 shared one process)
    alone = {name for name, _, _, spec in plan if spec.get("own")}
    todo = [name for name, _, _, _ in plan]
    events = out_dir / EVENTS
    events.write_text("")
    seen = 0
    last_step: dict[str, tuple[str, float]] = {}

    def record(name, result, seconds):
        out[section[name]] += result
        out["stage_s"][name] = seconds
        todo.remove(name)
        ok = all(r.get("ok") for r in result)
        print(f"[device_check] {name}: {'ok' if ok else 'FAILED'} ({seconds} s)", flush=True)
        on_record(out)

    while todo:
        # a measurement starts only with half its limit left in the budget: one started with less
        # is mostly cut at the deadline, device time spent for nothing. Those passed over go to
        # the rerun list; a shorter one after them may still run
        while todo and deadline - time.time() < limit[todo[0]] / 2:
            out["skipped"].append(todo.pop(0))
        if not todo:
            break
        # one process runs the measurements up to the next one that must run alone
        batch = todo[:1] if todo[0] in alone else [n for n in todo[:next(
            (i for i, n in enumerate(todo) if n in alone), len(todo))]]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", "work", "--out", str(out_dir),
               "--names", json.dumps(batch)] + (["--dry-run"] if mode == "dry-run" else []) + \
            (["--memory-bytes", str(shapes["memory_bytes"]), "--memory-source", shapes["source"]]
             if shapes and shapes["memory_bytes"] else [])
        cmd += ["--compile-cache", cache]
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)  # its own group: killed whole
        started, current, began = time.time(), None, 0.0
        while True:
            rc = proc.poll()
            text = events.read_text()
            lines = text[:text.rfind("\n") + 1].splitlines()  # whole lines only
            for line in lines[seen:]:
                e = json.loads(line)
                if e["event"] == "devices":
                    out.update(platform=e["platform"], jax=e["jax"], devices=e["devices"])
                elif e["event"] == "start":
                    current, began = e["name"], time.time()
                elif e["event"] == "progress":
                    last_step[e["name"]] = (e["what"], round(time.time() - began, 1))
                elif e["event"] == "done":
                    record(e["name"], e["result"], e["seconds"])
                    current, started = None, time.time()  # the next start is timed from here
            seen = len(lines)
            now = time.time()
            over = (current is not None and now > min(began + limit[current], deadline)) or \
                   (current is None and rc is None and now > min(started + STARTUP_LIMIT_S, deadline))
            if rc is None and not over:
                time.sleep(0.2)
                continue
            if rc is None:  # over its limit: the measurement (or the start-up) is killed with its group
                os.killpg(proc.pid, 9)
                proc.wait()
            if current is not None:
                spent = round(now - began, 1)
                cut = rc is None and budget_cut(began, limit[current], deadline)
                if cut:        # the budget's end, not the measurement's own limit: it goes on the rerun list
                    why = f"cut by the time budget after {spent} s (its limit {limit[current]:g} s): rerun it"
                elif rc is None:
                    out["timed_out"].append(current)
                    why = f"timed out after {spent} s (limit {limit[current]:g} s)"
                else:
                    why = f"its process exited with code {rc} during the measurement"
                if rc is None and current in last_step:
                    why += f"; last step: {last_step[current][0]} (at {last_step[current][1]:g} s)"
                record(current, [{"check": current, "stage": current, "ok": False,
                                  "timed_out": rc is None and not cut, "cut": cut, "error": why}], spent)
                if cut:
                    out["skipped"].append(current)
            elif any(n in todo for n in batch):
                out["errors"].append(f"the measuring process did not start ({'timed out' if rc is None else f'exit code {rc}'})"
                                     f"; not run: {', '.join(todo)}")
                out["skipped"] += todo
                todo.clear()
            break
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                   help="directory for device_check.json and device_check.md (default: $OUT)")
    p.add_argument("--dry-run", action="store_true", help="every step on this CPU at tiny shapes; installs nothing")
    p.add_argument("--no-install", action="store_true", help="use the jax already installed")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="no measurement starts or runs past this many seconds from the start (install included)")
    p.add_argument("--stage-timeout-s", type=float, default=None,
                   help="time limit of every measurement (default: each its own, STAGES)")
    p.add_argument("--only", default="", help="comma-separated measurement names to run, in that order (default: all)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="plan the shapes for a device of this many GiB (default: nvidia-smi's memory.total)")
    p.add_argument("--compile-cache", default="", help="the children's persistent compilation cache: a directory, "
                   "or off (default: $JAX_COMPILATION_CACHE_DIR, else runs/device_check_cache)")
    p.add_argument("--stage", choices=("all", "work"), default="all", help=argparse.SUPPRESS)
    p.add_argument("--names", default="[]", help=argparse.SUPPRESS)
    p.add_argument("--memory-bytes", type=int, default=None, help=argparse.SUPPRESS)   # the parent's figure
    p.add_argument("--memory-source", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.out is None:
        p.error("--out DIR is required where $OUT is not set")
    mode = "dry-run" if args.dry_run else "device"
    if args.stage == "work":
        return child(mode, json.loads(args.names), args.out, args.memory_bytes, args.memory_source, args.compile_cache)
    started = time.time()
    platform = detect_platform()
    if mode == "device" and platform == "cpu":
        print("device_check: no NVIDIA GPU (nvidia-smi) or TPU (/dev/accel*) on this host; "
              "--dry-run runs the same steps on the CPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    # before the plan: planning imports the project's memory plans (jax among them), which a
    # host without its jax installed yet only has after this
    info = install(platform, args.dry_run, args.no_install)
    if args.memory_gib:
        memory, source = int(args.memory_gib * 2 ** 30), "--memory-gib"
    elif mode == "device" and platform == "gpu":
        memory, source = gpu_memory_bytes(), "nvidia-smi memory.total"
    else:
        memory, source = None, ""
    shapes = choose(mode, platform, memory, source)   # from the memory figure; this process never starts jax
    plan = stages(mode, platform, shapes)
    if args.only:
        plan, refused = only(plan, shapes, args.only)
        if refused:
            print(f"device_check: --only {refused}", file=sys.stderr)
            return 2
    rep = {"schema": 3, "mode": mode, "install": info, "shapes": shapes, "compile_cache": cache_dir(args.compile_cache)}

    def write(out: dict, final: bool = False) -> None:
        rep.update(out)
        rep["elapsed_s"] = round(time.time() - started, 1)
        rep["ok"] = final and not rep["errors"] and not rep["skipped"] and not (shapes["dropped"] and not args.only) \
            and all(r.get("ok") for key in SECTIONS for r in rep[key])
        apply_ceilings(rep)
        (args.out / "device_check.json").write_text(json.dumps(rep, indent=1))
        (args.out / "device_check.md").write_text(markdown(rep))

    out = run_stages(mode, platform, args.out, plan, started + args.budget_s, args.stage_timeout_s, on_record=write,
                     shapes=shapes, cache=rep["compile_cache"])
    write(out, final=True)
    print(markdown(rep))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
