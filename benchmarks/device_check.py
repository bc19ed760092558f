"""The first command to run on new hardware: one NVIDIA GPU host or one TPU VM, nothing
installed but Python and this repository.

    python benchmarks/device_check.py --out DIR [--no-install] [--budget-s 480] [--only NAME,...]
    python benchmarks/device_check.py --out DIR --dry-run      # on any CPU host: the same steps, tiny shapes

1. Finds the accelerator (`nvidia-smi` -> gpu, /dev/accel* or /dev/vfio -> tpu) and installs
   the matching extra (`pip install -e '.[cuda]'` or `'.[tpu]'`) unless jax already sees it.
2. Runs the measurements in a child interpreter (it imports what was installed; this process
   never starts jax, so it never holds the device). Each measurement has a time limit
   (STAGES; --stage-timeout-s overrides), and none may run past --budget-s from the start: a
   measurement over its limit is killed with its process, recorded as timed out, and the rest
   go on in a fresh child. On the device (jax.local_devices()):
   - attention parity: the platform's fused kernel (cudnn on GPU, splash on TPU) against
     "xla", forward and the gradients of q, k, v, bf16, right-padded rows;
   - sampler parity: greedy tokens of the tiny model on the device equal the CPU backend's
     (float32, xla attention, highest matmul precision); bf16 with the fused kernel reported
     (device mode only);
   - train step: one update of Qwen3-0.6B and Qwen3-4B shapes (random weights, remat full,
     FSDP over the local devices), fused kernel vs xla: compile s, step s, tokens/s, MFU
     (model FLOPs / (step s x peak x devices)), peak device memory (memory_stats
     peak_bytes_in_use: the process's peak so far) vs `train --check`'s analytic plan;
   - decode tokens/s of Qwen3-0.6B on one device, the static sampler and the paged engine on
     the same workload, against the HBM bound (every weight read once per step plus the KV
     cache attended over).
3. Writes DIR/device_check.json and DIR/device_check.md (format: docs/formats.md, "Device
   check report"); exit 0 when every check passed.

--dry-run runs every step on this host's CPU at tiny shapes (no install: it says what it
would install), so CI proves the script end to end.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRA = {"gpu": "cuda", "tpu": "tpu"}
# (preset, rows per device, sequence, response tokens) of the timed train steps
TRAIN = {"device": [("qwen3-0.6b", 1, 4096, 512), ("qwen3-4b", 1, 4096, 512)],
         "dry-run": [("tiny", 1, 64, 16)]}
DECODE = {"device": dict(preset="qwen3-0.6b", prompts=8, prompt_len=1024, samples=4, max_new=256),
          "dry-run": dict(preset="tiny", prompts=2, prompt_len=32, samples=2, max_new=8)}
PARITY = {"device": dict(batch=2, seq=2048, kv_heads=8, groups=4, head_dim=128),
          "dry-run": dict(batch=2, seq=64, kv_heads=2, groups=2, head_dim=16)}


def detect_platform() -> str:
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidia0"):
        return "gpu"
    if glob.glob("/dev/accel*") or os.path.exists("/dev/vfio/0"):
        return "tpu"
    return "cpu"


def _jax_sees(platform: str) -> bool:
    probe = f"import jax, actionopd_jax.model; assert jax.devices()[0].platform == {platform!r}"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, cwd=ROOT).returncode == 0


def install(platform: str, dry_run: bool, skip: bool) -> dict:
    extra = EXTRA.get(platform, "")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "-e", f".[{extra}]"] if extra else []
    info = {"extra": extra, "command": " ".join(cmd), "seconds": 0.0, "skipped": ""}
    if dry_run or skip or not extra:
        info["skipped"] = "dry run" if dry_run else ("--no-install" if skip else "no accelerator")
        return info
    if _jax_sees(platform):
        info["skipped"] = f"jax already sees the {platform}"
        return info
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    return info


FAST = {"gpu": "cudnn", "tpu": "splash"}  # the fused kernel timed against xla (as device_check_work.fast_kernel)
# time limit of each measurement (s), first compile included; the longest is the 4B train step
LIMIT_S = {"attention parity": 90.0, "sampler parity": 120.0, "train": 150.0, "decode": 120.0}
STARTUP_LIMIT_S = 180.0  # the child's jax import and device start, before its first measurement
EVENTS = "device_check_events.jsonl"


def stages(mode: str, platform: str) -> list[tuple[str, str, float]]:
    """(name, report section, time limit s) of every measurement, in the order they run."""
    fast = FAST.get(platform, "cpu") if mode == "device" else "cpu"
    plan = [("attention parity", "parity", LIMIT_S["attention parity"]),
            ("sampler parity", "parity", LIMIT_S["sampler parity"])]
    for preset, *_ in TRAIN[mode]:
        plan += [(f"train {preset} {a}", "train_step", LIMIT_S["train"]) for a in dict.fromkeys((fast, "xla"))]
    return plan + [("decode", "decode", LIMIT_S["decode"]), ("engine decode", "decode", LIMIT_S["decode"])]


def child(mode: str, names: list[str], out_dir: Path) -> int:
    """`--stage work`: run the named measurements in this interpreter, one event line each
    (start, done) appended to DIR/device_check_events.jsonl for the parent to follow."""
    if mode == "dry-run":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import device_check_work as w

    log = open(out_dir / EVENTS, "a")

    def emit(**event):
        log.write(json.dumps(event) + "\n")
        log.flush()

    # a dry run on one CPU device whatever the host has (the smallest programs to compile)
    devices = jax.local_devices() if mode == "device" else jax.local_devices()[:1]
    platform = devices[0].platform if mode == "device" else "cpu"
    emit(event="devices", platform=platform, jax=jax.__version__,
         devices=[{"kind": d.device_kind, "platform": d.platform} for d in devices])
    calls = {"attention parity": lambda: w.attention_parity(platform, **PARITY[mode]),
             "sampler parity": lambda: w.sampler_parity(devices[0], bf16=mode == "device"),
             "decode": lambda: w.decode_timing(**DECODE[mode]),
             "engine decode": lambda: w.decode_timing(**DECODE[mode], sampler="engine")}
    shapes = {preset: (rows, seq, resp) for preset, rows, seq, resp in TRAIN[mode]}

    def call(name):
        if name.startswith("train "):  # "train PRESET ATTENTION" (stages())
            _, preset, attention = name.split(" ")
            rows, seq, resp = shapes[preset]
            return w.train_step_timing(preset, attention, rows=rows * len(devices), seq=seq, resp=resp,
                                       reps=2 if mode == "device" else 1, devices=devices)
        return calls[name]()

    for name in names:
        emit(event="start", name=name)
        t0 = time.time()
        try:
            res = call(name)
        except Exception as e:  # noqa: BLE001 - a failed measurement is a result
            res = {"check": name, "ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        emit(event="done", name=name, result=res if isinstance(res, list) else [res], seconds=round(time.time() - t0, 1))
    return 0


def run_stages(mode: str, platform: str, out_dir: Path, plan, deadline: float, stage_timeout: float | None) -> dict:
    """Every measurement of `plan` in child interpreters, each killed at its time limit or at
    `deadline`; what the deadline leaves unstarted is listed under "skipped"."""
    out = {"platform": platform, "jax": "", "devices": [], "parity": [], "train_step": [], "decode": [],
           "skipped": [], "timed_out": [], "errors": [], "stage_s": {}}
    section = {name: sec for name, sec, _ in plan}
    limit = {name: stage_timeout or lim for name, _, lim in plan}
    todo = [name for name, _, _ in plan]
    events = out_dir / EVENTS
    events.write_text("")
    seen = 0

    def record(name, result, seconds):
        out[section[name]] += result
        out["stage_s"][name] = seconds
        todo.remove(name)
        ok = all(r.get("ok") for r in result)
        print(f"[device_check] {name}: {'ok' if ok else 'FAILED'} ({seconds} s)", flush=True)

    while todo:
        if time.time() >= deadline:
            out["skipped"] += todo
            break
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", "work", "--out", str(out_dir),
               "--names", json.dumps(todo)] + (["--dry-run"] if mode == "dry-run" else [])
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
                elif e["event"] == "done":
                    record(e["name"], e["result"], e["seconds"])
                    current = None
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
                if rc is None:
                    out["timed_out"].append(current)
                    why = f"timed out after {spent} s (limit {round(min(limit[current], deadline - began), 1):g} s)"
                else:
                    why = f"its process exited with code {rc} during the measurement"
                record(current, [{"check": current, "ok": False, "timed_out": rc is None, "error": why}], spent)
            elif todo:
                out["errors"].append(f"the measuring process did not start ({'timed out' if rc is None else f'exit code {rc}'})"
                                     f"; not run: {', '.join(todo)}")
                out["skipped"] += todo
                todo.clear()
            break
    return out


def _fmt(x, spec="{:.3g}"):
    return "-" if x is None else spec.format(x)


def markdown(rep: dict) -> str:
    kinds = ", ".join(sorted({d["kind"] for d in rep["devices"]}))
    lines = [f"# device check ({rep['mode']}): {len(rep['devices'])} x {kinds}, jax {rep['jax']}", "",
             "| check | result | detail |", "| --- | --- | --- |"]
    for p in rep["parity"]:
        detail = (f"fwd rel err {_fmt(p.get('forward_rel_err'))}, grad {_fmt(p.get('grad_rel_err'))}"
                  if "forward_rel_err" in p else f"{p.get('rows_equal', '-')}/{p.get('rows', '-')} rows equal"
                  if "rows" in p else p.get("error", ""))
        lines.append(f"| {p['check']} | {'ok' if p['ok'] else 'FAILED'} | {detail} |")
    lines += ["", "| train step | attention | devices | rows x tokens | compile s | step s | tokens/s | MFU | "
              "peak GiB | plan GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    gib = 1024 ** 3
    for t in rep["train_step"]:
        if "step_s" not in t:
            lines.append(f"| {t['check']} | FAILED: {t.get('error', '')} | | | | | | | | |")
            continue
        lines.append(f"| {t['model']} | {t['attention']} | {t['devices']} | {t['rows']} x {t['seq_len']} | "
                     f"{t['compile_s']} | {t['step_s']} | {t['tokens_per_s']:,.0f} | "
                     f"{_fmt(t['mfu'], '{:.1%}')} | {_fmt(t['peak_bytes'] and t['peak_bytes'] / gib, '{:.1f}')} | "
                     f"{t['plan_bytes'] / gib:.1f} |")
    lines += ["", "| decode | sampler | rows | prompt + new | tokens/s | HBM bound tokens/s | of bound |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for d in rep["decode"]:
        if "tokens_per_s" not in d:
            lines.append(f"| {d['check']} | FAILED: {d.get('error', '')} | | | | | |")
            continue
        lines.append(f"| {d['model']} | {d['sampler']} | {d['rows']} | {d['prompt_len']} + {d['max_new']} | "
                     f"{d['tokens_per_s']:,.0f} | {_fmt(d['hbm_bound_tokens_per_s'], '{:,.0f}')} | "
                     f"{_fmt(d['fraction_of_bound'], '{:.1%}')} |")
    if rep["timed_out"]:
        lines += ["", "timed out (killed at their time limit): " + ", ".join(rep["timed_out"])]
    if rep["skipped"]:
        lines += ["", "skipped (time budget): " + ", ".join(rep["skipped"])]
    lines += [f"error: {e}" for e in rep["errors"]]
    lines += ["", f"install: {rep['install']['command'] or '-'} ({rep['install']['skipped'] or str(rep['install']['seconds']) + ' s'}); "
              f"elapsed {rep['elapsed_s']} s; {'ALL OK' if rep['ok'] else 'SOME CHECK FAILED'}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="directory for device_check.json and device_check.md")
    p.add_argument("--dry-run", action="store_true", help="every step on this CPU at tiny shapes; installs nothing")
    p.add_argument("--no-install", action="store_true", help="use the jax already installed")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="nothing runs past this many seconds from the start (install included)")
    p.add_argument("--stage-timeout-s", type=float, default=None,
                   help="time limit of every measurement (default: each its own, LIMIT_S)")
    p.add_argument("--only", default="", help="comma-separated measurement names to run (default: all)")
    p.add_argument("--stage", choices=("all", "work"), default="all", help=argparse.SUPPRESS)
    p.add_argument("--names", default="[]", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    mode = "dry-run" if args.dry_run else "device"
    if args.stage == "work":
        return child(mode, json.loads(args.names), args.out)
    started = time.time()
    platform = detect_platform()
    if mode == "device" and platform == "cpu":
        print("device_check: no NVIDIA GPU (nvidia-smi) or TPU (/dev/accel*) on this host; "
              "--dry-run runs the same steps on the CPU", file=sys.stderr)
        return 2
    plan = stages(mode, platform)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {name for name, _, _ in plan})
        if unknown:
            print(f"device_check: --only {', '.join(unknown)}: no such measurement; the measurements are: "
                  f"{', '.join(name for name, _, _ in plan)}", file=sys.stderr)
            return 2
        plan = [row for row in plan if row[0] in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    info = install(platform, args.dry_run, args.no_install)
    rep = {"schema": 2, "mode": mode, "install": info,
           **run_stages(mode, platform, args.out, plan, started + args.budget_s, args.stage_timeout_s)}
    rep["elapsed_s"] = round(time.time() - started, 1)
    rep["ok"] = not rep["errors"] and all(r.get("ok") for key in ("parity", "train_step", "decode") for r in rep[key])
    (args.out / "device_check.json").write_text(json.dumps(rep, indent=1))
    (args.out / "device_check.md").write_text(markdown(rep))
    print(markdown(rep))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
