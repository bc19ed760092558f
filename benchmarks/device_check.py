"""The first command to run on new hardware: one NVIDIA GPU host or one TPU VM, nothing
installed but Python and this repository.

    python benchmarks/device_check.py --out DIR [--no-install] [--budget-s 480]
    python benchmarks/device_check.py --out DIR --dry-run      # on any CPU host: the same steps, tiny shapes

1. Finds the accelerator (`nvidia-smi` -> gpu, /dev/accel* or /dev/vfio -> tpu) and installs
   the matching extra (`pip install -e '.[cuda]'` or `'.[tpu]'`) unless jax already sees it;
   the work then runs in a fresh interpreter (`--stage work`) that imports what was installed.
2. On the device (jax.local_devices()):
   - attention parity: the platform's fused kernel (cudnn on GPU, splash on TPU) against
     "xla", forward and the gradients of q, k, v, bf16, right-padded rows;
   - sampler parity: greedy tokens of the tiny model on the device equal the CPU backend's
     (float32, xla attention, highest matmul precision); bf16 with the fused kernel reported
     (device mode only);
   - train step: one update of Qwen3-0.6B and Qwen3-4B shapes (random weights, remat full,
     FSDP over the local devices), fused kernel vs xla: compile s, step s, tokens/s, MFU
     (model FLOPs / (step s x peak x devices)), peak device memory (memory_stats
     peak_bytes_in_use: the process's peak so far) vs `train --check`'s analytic plan;
   - sampler decode tokens/s of Qwen3-0.6B on one device against the HBM bound (every
     weight read once per step plus the KV cache attended over).
3. Writes DIR/device_check.json and DIR/device_check.md; exit 0 when every check passed.

Output format (device_check.json): {"schema": 1, "mode": "device" | "dry-run", "platform",
"devices": [{"kind", "platform"}], "jax": version, "install": {"extra", "command", "seconds",
"skipped"}, "parity": [{"check", "ok", ...}], "train_step": [{"model", "attention", "devices",
"rows", "seq_len", "resp_len", "compile_s", "step_s", "tokens_per_s", "mfu", "peak_bytes",
"plan_bytes", "ok"}], "decode": [{"model", "rows", "prompt_len", "max_new", "decode_steps",
"decode_s", "tokens_per_s", "hbm_bound_tokens_per_s", "fraction_of_bound", "ok"}], "skipped":
[what the time budget left out], "stage_s": {measurement: wall seconds}, "elapsed_s", "ok"}. device_check.md holds the same as three
tables. --dry-run runs every step on this host's CPU at tiny shapes (no install: it says what
it would install), so CI proves the script end to end.
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


def work(mode: str, platform: str, deadline: float) -> dict:
    """Every measurement, each skipped (and listed) when the time budget is spent."""
    if mode == "dry-run":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import device_check_work as w

    # a dry run on one CPU device whatever the host has (the smallest programs to compile)
    devices = jax.local_devices() if mode == "device" else jax.local_devices()[:1]
    platform = devices[0].platform if mode == "device" else "cpu"
    fast = w.fast_kernel(platform)
    out = {"platform": platform, "jax": jax.__version__, "devices": [{"kind": d.device_kind, "platform": d.platform}
                                                                    for d in devices],
           "parity": [], "train_step": [], "decode": [], "skipped": [], "stage_s": {}}

    def timed(name, fn, into):
        if time.time() > deadline:
            out["skipped"].append(name)
            return
        t0 = time.time()
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 - a failed measurement is a result
            res = {"check": name, "ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        res = res if isinstance(res, list) else [res]
        out[into] += res
        out["stage_s"][name] = round(time.time() - t0, 1)
        print(f"[device_check] {name}: {'ok' if all(r.get('ok') for r in res) else 'FAILED'} "
              f"({out['stage_s'][name]} s)", flush=True)

    timed("attention parity", lambda: w.attention_parity(platform, **PARITY[mode]), "parity")
    timed("sampler parity", lambda: w.sampler_parity(devices[0], bf16=mode == "device"), "parity")
    for preset, rows, seq, resp in TRAIN[mode]:
        for attention in dict.fromkeys((fast, "xla")):
            timed(f"train {preset} {attention}", lambda p=preset, a=attention, r=rows: w.train_step_timing(
                p, a, rows=r * len(devices), seq=seq, resp=resp, reps=2 if mode == "device" else 1,
                devices=devices), "train_step")
    timed("decode", lambda: w.decode_timing(**DECODE[mode]), "decode")
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
    lines += ["", "| decode | rows | prompt + new | tokens/s | HBM bound tokens/s | of bound |",
              "| --- | --- | --- | --- | --- | --- |"]
    for d in rep["decode"]:
        if "tokens_per_s" not in d:
            lines.append(f"| {d['check']} | FAILED: {d.get('error', '')} | | | | |")
            continue
        lines.append(f"| {d['model']} | {d['rows']} | {d['prompt_len']} + {d['max_new']} | {d['tokens_per_s']:,.0f} | "
                     f"{_fmt(d['hbm_bound_tokens_per_s'], '{:,.0f}')} | {_fmt(d['fraction_of_bound'], '{:.1%}')} |")
    if rep["skipped"]:
        lines += ["", "skipped (time budget): " + ", ".join(rep["skipped"])]
    lines += ["", f"install: {rep['install']['command'] or '-'} ({rep['install']['skipped'] or str(rep['install']['seconds']) + ' s'}); "
              f"elapsed {rep['elapsed_s']} s; {'ALL OK' if rep['ok'] else 'SOME CHECK FAILED'}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="directory for device_check.json and device_check.md")
    p.add_argument("--dry-run", action="store_true", help="every step on this CPU at tiny shapes; installs nothing")
    p.add_argument("--no-install", action="store_true", help="use the jax already installed")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting measurements after this long")
    p.add_argument("--stage", choices=("all", "work"), default="all", help=argparse.SUPPRESS)
    p.add_argument("--started", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    started = args.started or time.time()
    mode = "dry-run" if args.dry_run else "device"
    platform = detect_platform()
    if mode == "device" and platform == "cpu":
        print("device_check: no NVIDIA GPU (nvidia-smi) or TPU (/dev/accel*) on this host; "
              "--dry-run runs the same steps on the CPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "all":
        info = install(platform, args.dry_run, args.no_install)
        if info["seconds"]:  # new packages: measure in an interpreter that imports them
            cmd = [sys.executable, __file__, "--out", str(args.out), "--stage", "work", "--started", str(started),
                   "--budget-s", str(args.budget_s)]
            (args.out / "install.json").write_text(json.dumps(info))
            return subprocess.run(cmd, cwd=ROOT).returncode
    else:
        path = args.out / "install.json"
        info = json.loads(path.read_text()) if path.exists() else {"extra": "", "command": "", "seconds": 0.0,
                                                                    "skipped": "not recorded"}
    rep = {"schema": 1, "mode": mode, "install": info, **work(mode, platform, started + args.budget_s)}
    rep["elapsed_s"] = round(time.time() - started, 1)
    rep["ok"] = all(r.get("ok") for key in ("parity", "train_step", "decode") for r in rep[key])
    (args.out / "device_check.json").write_text(json.dumps(rep, indent=1))
    (args.out / "device_check.md").write_text(markdown(rep))
    print(markdown(rep))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
