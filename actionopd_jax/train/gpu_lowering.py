"""`actionopd train --check` for a GPU target: the run's real programs lowered for CUDA.

On a host without the GPUs every program the run compiles on its GPUs is traced for "gpu" over
CPU stand-ins of the target's devices (same count, same mesh) and lowered to CUDA StableHLO
(aot/lowering.py), with abstract shapes at the run's real sizes, nothing allocated:

- the train step's update (and the old-logprob recompute when the run does it) over the
  training mesh (FSDP over the target's GPUs): sharding, partitioning and the CUDA lowering of
  every primitive; the cuDNN calls are still behind the partitioner there
  (`CustomSPMDPartitioning`), so
- the same update as ONE GPU's program (its rows on a one-device mesh): the cuDNN flash
  attention calls themselves, forward and backward, must be in its StableHLO;
- the sampler's prefill and decode at the collection's largest call (tensor-parallel over a
  host's GPUs, the rollout copy's layout), and prefill as one GPU's program; with
  `collect.sampler: engine` (not auto's choice on GPUs: config/rollout.py), the engine's prefill chunk and decode segment instead
  (engine/aot.py, the same layout), whose paged attention must be the Triton kernel.

A program that uses cuDNN attention but whose one-device lowering holds no cuDNN call is a
failure too (the kernel was not what ran). Memory stays the analytic plan here; `--check --aot`
compiles the update for the target's GPUs by XLA's deviceless GPU compiler (aot/gpu_topology.py)
for the compiler's memory figure.
"""

from __future__ import annotations

import math

import jax

from actionopd_jax.aot.lowering import LoweringReport, cuda_lowering_missing, lower_for, lowering_for
from actionopd_jax.aot.targets import Target, TargetUnavailable, target_devices
from actionopd_jax.config import Config
from actionopd_jax.config.rollout import rollout_sampler
from actionopd_jax.model import Qwen3Config, make_mesh
from actionopd_jax.model.attention import resolve
from actionopd_jax.train.aot_check import _abstract_batch, aot_lengths
from actionopd_jax.train.batching import bucket_length

CUDNN_FORWARD = "__cudnn$fmhaSoftmax"
CUDNN_BACKWARD = "__cudnn$fmhaSoftmaxBackward"
PARTITIONED = "CustomSPMDPartitioning"


def stand_in_devices(n: int) -> list:
    """n CPU devices of this process to trace a GPU mesh over; a clear error when too few."""
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        raise TargetUnavailable(
            f"lowering for {n} GPUs needs {n} host CPU devices to stand in for them; this process has "
            f"{len(cpus)} (jax started before they could be asked for): run `actionopd train --check` as its own "
            f"command, or set XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    return cpus[:n]


def request_stand_ins(n: int) -> None:
    """Ask jax for n host CPU devices if its backends have not started yet (a fresh
    `actionopd train --check`); otherwise leave them (stand_in_devices then says if too few)."""
    import os
    import re

    flag = re.search(r"xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    asked = int(flag.group(1)) if flag else 1
    if n <= asked:
        return
    try:  # wins over XLA_FLAGS; never fewer than the flag asked for
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already started: whatever they have
        pass


def lower_train_step(cfg: Config, qcfg: Qwen3Config, mesh, rows: int, seq_len: int, resp_len: int,
                     label: str, *, old_logprobs: bool = False) -> list[LoweringReport]:
    """The trainer's own update program (and old-logprob program) lowered for CUDA over `mesh`."""
    from actionopd_jax.train.setup import build_train_step

    with lowering_for("gpu"):
        step = build_train_step(cfg, qcfg, mesh)  # the run's attention checks, for the GPU
        args = (step.abstract_state(), _abstract_batch(step, rows, seq_len, resp_len))
    reports = [lower_for(step._update, args, label=f"train update, {label}", mesh=mesh)]
    if old_logprobs:
        reports.append(lower_for(step._old_logp, (args[0]["params"], args[1]), label=f"old logprobs, {label}",
                                 mesh=mesh))
    return reports


def _collection_call(cfg: Config) -> dict:
    """The sampler's largest collection call: a prompt at the cap, N candidates, the response
    budget, as many states as the buckets allow (collect.concurrency, <= Buckets.max_rows rows)."""
    from actionopd_jax.sampling.buckets import Buckets

    c, b = cfg.collect, Buckets()
    samples = Buckets.fit(c.num_candidates, b.samples, "samples")
    prompts = min(Buckets.fit(max(1, c.concurrency), b.prompts, "prompts"), max(1, b.max_rows // samples))
    return dict(prompts=prompts, samples=samples,
                prompt_len=Buckets.fit(min(c.max_prompt_tokens, cfg.train.max_seq_len), b.prompt_len, "prompt_len"),
                max_new=Buckets.fit(c.max_response_tokens, b.max_new, "max_new"))


def lower_run_programs(cfg: Config, qcfg: Qwen3Config, target: Target) -> tuple[list[LoweringReport], str]:
    """Every program of the run lowered for CUDA, and the attention kernel it uses."""
    from actionopd_jax.sampling.aot import lower_sampler_programs
    from actionopd_jax.train.setup import mesh_shape, runtime_options

    runtime = runtime_options(cfg)
    attention = resolve(cfg.model.attention, "gpu")
    devices = stand_in_devices(target.chips)
    sizes = mesh_shape(cfg, target.chips)
    mesh = make_mesh(sizes, devices=devices[:math.prod(sizes.values())])
    rows = cfg.train.microbatch_rows
    seq_len = aot_lengths(cfg)[-1]
    resp_len = min(bucket_length(cfg.collect.max_response_tokens, 16), seq_len - 1)
    recompute = cfg.train.old_logprobs == "recompute"
    reports = lower_train_step(cfg, qcfg, mesh, rows, seq_len, resp_len, f"{rows} x {seq_len:,}",
                               old_logprobs=recompute)
    local_rows = max(1, rows // (sizes.get("data", 1) * sizes.get("fsdp", 1)))
    if mesh.size > 1:
        one = make_mesh({k: 1 for k in sizes}, devices=devices[:1])
        reports += lower_train_step(cfg, qcfg, one, local_rows, seq_len, resp_len,
                                    f"one GPU's program: {local_rows} x {seq_len:,}")
    k = cfg.mesh.rollout_devices   # the sampler's own chips (the last k), else a host's all
    host = make_mesh({"tensor": k or target.chips_per_host},
                     devices=devices[-k:] if k else devices[:target.chips_per_host])
    if rollout_sampler(cfg.collect.sampler, "gpu") == "engine":
        from actionopd_jax.engine.aot import engine_shapes, lower_engine_programs

        reports += lower_engine_programs(qcfg, host, engine_shapes(cfg.collect), runtime=runtime)
    else:
        call = _collection_call(cfg)
        reports += lower_sampler_programs(qcfg, host, runtime=runtime, **call)
        if host.size > 1:  # one GPU's prefill: its cuDNN calls
            reports += lower_sampler_programs(qcfg, make_mesh({"tensor": 1}, devices=devices[:1]), runtime=runtime,
                                              **call)[:1]
            reports[-1].label = reports[-1].label.replace("sampler prefill (", "sampler prefill on one GPU (")
    if attention == "cudnn":
        for r in reports:
            # the engine's paged attention is not cuDNN (its kernel is checked in engine/aot.py)
            if r.ok and r.partitions == 1 and r.label.startswith(("train", "old", "sampler prefill")):
                want = (CUDNN_FORWARD, CUDNN_BACKWARD) if r.label.startswith("train update") else (CUDNN_FORWARD,)
                missing = [w for w in want if w not in r.custom_calls]
                if missing:
                    r.ok, r.error = False, f"attention is cudnn but the lowered program has no {', '.join(missing)}"
    return reports, attention


def _calls(r: LoweringReport) -> str:
    kernels = [c for c in r.custom_calls if c.startswith("__cudnn") or "triton" in c]
    if kernels:
        return ", ".join(kernels)
    return "behind the partitioner" if PARTITIONED in r.custom_calls else "-"


def format_lowering(target: Target, reports: list[LoweringReport], attention: str, compile_note: str) -> str:
    head = (f"CUDA lowering for {target.name} ({target.chips} GPU(s)): the run's programs traced for GPU over "
            f"{target.chips} CPU stand-in device(s) of this host and lowered to CUDA StableHLO; abstract shapes, "
            f"nothing compiled or allocated; attention {attention}")
    cols = ("program", "result", "partitions", "cuDNN / Triton calls", "lower s")
    lines = [head, " | ".join(cols), " | ".join("---" for _ in cols)]
    for r in reports:
        lines.append(" | ".join([r.label, "lowered" if r.ok else "ERROR", str(r.partitions),
                                 _calls(r) if r.ok else "-", f"{r.seconds:.1f}"]))
        if not r.ok:
            lines.append(f"    {r.error}")
    lines.append(f"note: {compile_note}")
    lines.append("note: the memory plan above is analytic (train/plan.py), not a compiler figure")
    return "\n".join(lines)


def compile_note(target: Target) -> str:
    """Why the programs are lowered, not compiled (or that `--aot` can compile them here)."""
    try:
        devices = target_devices(target.name)
    except TargetUnavailable as e:
        return f"a deviceless GPU compile is not available in this jax ({jax.__version__}): {e}"
    where = ("this host's GPUs" if getattr(devices[0].client, "runtime_type", "") != "compile_only_runtime"
             else "XLA's GPU compiler without the GPUs (aot/gpu_topology.py)")
    return (f"`actionopd train --check --aot` compiles these programs for {target.chips} {devices[0].device_kind} "
            f"with {where}: the compiler's memory figures, not the plan's")


def gpu_target(cfg: Config, devices: int = 0) -> Target | None:
    """The GPU target `--check` lowers the run's programs for (None: no GPU target, or
    `--devices` replaced its chips). Asks jax for that many host stand-in devices, so call it
    before anything starts jax's backends."""
    if not cfg.mesh.target or devices:
        return None
    from actionopd_jax.aot.targets import get_target

    target = get_target(cfg.mesh.target)
    if target.platform != "gpu":
        return None
    request_stand_ins(target.chips)
    return target


def lower_if_gpu(cfg: Config, qcfg: Qwen3Config, target: Target | None, out=print) -> bool:
    """`--check`'s CUDA lowering for a GPU target: False only when a program fails to lower.
    Without the CUDA packages it says what to install and goes on (the plan still holds)."""
    if target is None:
        return True
    missing = cuda_lowering_missing()
    if missing:
        out(f"CUDA lowering: not run: {missing}")
        return True
    return run_gpu_lowering(cfg, qcfg, target, out)


def run_gpu_lowering(cfg: Config, qcfg: Qwen3Config, target: Target, out=print) -> bool:
    """Lower and print; True when every program lowered (and used cuDNN where it should)."""
    try:
        reports, attention = lower_run_programs(cfg, qcfg, target)
    except TargetUnavailable as e:
        out(f"CUDA lowering: not run: {e}")
        return False
    out(format_lowering(target, reports, attention, compile_note(target)))
    return all(r.ok for r in reports)
