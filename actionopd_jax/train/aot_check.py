"""`actionopd train --check --aot`: compile the run's real train-step program for its target.

The program is the trainer's own `TrainStep._update` (one optimizer update over the run's
microbatches of `train.microbatch_rows` rows, update_microbatches: with more than one, the f32
gradient accumulator is in the memory figure), with the config's model, optimizer, remat,
attention and mesh, on the target's devices (a TPU topology from libtpu; no hardware needed).
Reported per chip: memory by kind against HBM, the compiler's FLOPs and estimated seconds,
the model FLOPs utilisation those imply, and the compile time.

Cost caveat (measured): XLA's cost model counts a while/scan body once, so with layers under
`scan` the compiler's FLOPs cover one layer. The check therefore also compiles the same step
with 1 and 2 layers unrolled and extrapolates linearly to the real depth. Pallas kernels
(splash attention) carry no cost estimate: their FLOPs are missing from the compiler's count,
so the estimate adds the kernel's analytic FLOPs at the chip's peak rate (an optimistic time
for the kernel), and says so.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from actionopd_jax.aot import CompileReport, Target, compile_for, format_bytes, get_target, target_devices
from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION
from actionopd_jax.config import Config
from actionopd_jax.model import Qwen3Config, make_mesh
from actionopd_jax.model.attention import SharedPrefix, resolve
from actionopd_jax.model.config import count_params
from actionopd_jax.train.batching import BATCH_FIELDS, bucket_length, update_microbatches


@dataclasses.dataclass
class StepEstimate:
    """One train-step program: the compiled real program plus the cost extrapolation."""

    rows: int
    seq_len: int
    resp_len: int
    attention: str
    real: CompileReport
    flops_per_chip: float = 0.0        # compiler, extrapolated to every layer (+ kernel FLOPs)
    seconds: float = 0.0               # compiler's optimal seconds, extrapolated (+ kernel time)
    kernel_flops_per_chip: float = 0.0  # analytic FLOPs of Pallas kernels the compiler cannot see
    model_flops_per_chip: float = 0.0
    mfu: float = 0.0
    mfu_kernel_half: float = 0.0       # the same with the Pallas kernel at 50% of peak
    cost_note: str = ""


def attention_pairs(seq_len: int, layout: SharedPrefix | None) -> float:
    """(query, key) pairs one row attends: T^2/2 causal; a shared-prefix row: the prompt's
    causal square plus each response token over the prompt and its own response so far."""
    if layout is None:
        return seq_len * seq_len / 2
    p, r, n = layout.prompt, layout.response, layout.count
    return p * p / 2 + n * r * (p + r / 2)


def model_flops(qcfg: Qwen3Config, rows: int, seq_len: int, resp_len: int,
                layout: SharedPrefix | None = None) -> float:
    """Training FLOPs of one microbatch (forward + backward = 3x forward; no remat recompute):
    weight matmuls and attention over every token of the rows, the LM head on response tokens."""
    d, v, L = qcfg.hidden_size, qcfg.vocab_size, qcfg.num_hidden_layers
    h, dh = qcfg.num_attention_heads, qcfg.head_dim
    n = count_params(qcfg)["non_embedding"]
    attention = 3 * L * 4 * h * dh * attention_pairs(seq_len, layout)
    return rows * (seq_len * 6 * n + attention + resp_len * 6 * d * v)


def attention_kernel_flops(qcfg: Qwen3Config, rows: int, seq_len: int, layout: SharedPrefix | None = None,
                           remat: str = "none") -> float:
    """Hardware FLOPs of the attention kernel in one train step: forward (2 matmuls), backward
    (5 matmuls with the fused dq/dkv kernel), and the forward again under full remat."""
    L, h, dh = qcfg.num_hidden_layers, qcfg.num_attention_heads, qcfg.head_dim
    one_matmul = rows * L * h * dh * 2 * attention_pairs(seq_len, layout)
    recompute = 2 if remat in ("full", "dots") else 0
    return one_matmul * (2 + 5 + recompute)


def _abstract_batch(step, rows: int, seq_len: int, resp_len: int, behaviour: bool = False,
                    microbatches: int = 1) -> dict:
    out = {}
    shared = step.settings.shared_prompt > 0  # shared rows carry per-token advantages
    # collect.max_staleness >= 1: the update also reads the correction's behaviour log-probs
    fields = {**BATCH_FIELDS, **({"behav_logp": ("float32", "R")} if behaviour else {})}
    for name, (dtype, dim) in fields.items():
        width = (seq_len,) if dim == "T" else (resp_len,) if dim == "R" or shared else ()
        out[name] = jax.ShapeDtypeStruct((microbatches, rows) + width, jnp.dtype(dtype), sharding=step.row_sharding)
    return out


def _compile_step(cfg: Config, qcfg: Qwen3Config, mesh, rows: int, seq_len: int, resp_len: int,
                  label: str, runtime=None, persistent_cache: bool = False, microbatches: int = 1) -> CompileReport:
    from actionopd_jax.train.setup import build_train_step

    step = build_train_step(cfg, qcfg, mesh, runtime)
    args = (step.abstract_state(), _abstract_batch(step, rows, seq_len, resp_len, cfg.collect.max_staleness >= 1,
                                                   microbatches))
    return compile_for(step._update, args, label=label, mesh=mesh, persistent_cache=persistent_cache)


def target_mesh(cfg: Config, target: Target):
    from actionopd_jax.train.setup import mesh_shape

    devices = target_devices(target.name)
    shape = mesh_shape(cfg, target.chips)   # the training part: all chips, or the first chips - mesh.rollout_devices
    return make_mesh(shape, devices=devices[:math.prod(shape.values())])


def update_shapes(cfg: Config, seq_len: int) -> tuple[int, int, int, SharedPrefix | None, str]:
    """(rows, tokens a row, response tokens a row, shared-prompt layout, label) of the update
    program at `seq_len`: one microbatch of `train.microbatch_rows` rows, as the trainer packs it."""
    rows = cfg.train.microbatch_rows
    region = bucket_length(cfg.collect.max_response_tokens, 16)
    layout, label = None, f"{rows} x {seq_len:,}"
    if cfg.train.shared_prompt:  # packed rows: [prompt bucket | N response regions]
        n = cfg.collect.num_candidates
        prompt = bucket_length(min(cfg.collect.max_prompt_tokens, seq_len - region), cfg.train.bucket_multiple)
        layout = SharedPrefix(prompt=prompt, response=region, count=n)
        seq_len, resp_len = layout.length, n * region
        label = f"{rows} x {seq_len:,} ({prompt:,} + {n} x {region:,})"
    else:
        resp_len = min(region, seq_len - 1)
    return rows, seq_len, resp_len, layout, label


def update_memory(cfg: Config, qcfg: Qwen3Config, mesh, *, persistent_cache: bool = False) -> CompileReport:
    """The run's update at its largest sequence bucket, compiled on `mesh` (this host's devices
    or a target's): the compiler's memory verdict, without the cost twins. persistent_cache:
    `mesh` is this host's own devices (aot.compile_for)."""
    rows, seq_len, resp_len, _, label = update_shapes(cfg, aot_lengths(cfg)[-1])
    return _compile_step(cfg, qcfg, mesh, rows, seq_len, resp_len, label, persistent_cache=persistent_cache,
                         microbatches=update_microbatches(cfg))


def estimate_step(cfg: Config, qcfg: Qwen3Config, target: Target, seq_len: int, *,
                  cost: bool = True) -> StepEstimate:
    mesh = target_mesh(cfg, target)
    rows, seq_len, resp_len, layout, label = update_shapes(cfg, seq_len)
    impl = resolve(cfg.model.attention, target.platform)
    est = StepEstimate(rows=rows, seq_len=seq_len, resp_len=resp_len, attention=impl,
                       real=_compile_step(cfg, qcfg, mesh, rows, seq_len, resp_len, label,
                                          microbatches=update_microbatches(cfg)))
    est.model_flops_per_chip = model_flops(qcfg, rows, seq_len, resp_len, layout) / mesh.size  # the training chips
    if not (cost and est.real.ok):
        return est
    # per-layer cost from 1- and 2-layer unrolled twins of the same program
    from actionopd_jax.train.setup import runtime_options

    unrolled = runtime_options(cfg).replace(scan_unroll=0)
    twins = [_compile_step(cfg, qcfg.replace(num_hidden_layers=n), mesh, rows, seq_len,
                           resp_len, f"{n} layer(s)", unrolled) for n in (1, 2)]
    if not all(t.ok for t in twins):
        est.cost_note = "cost twins did not compile: " + "; ".join(t.error for t in twins if not t.ok)
        return est
    L = qcfg.num_hidden_layers
    per_layer_f = twins[1].flops - twins[0].flops
    per_layer_s = twins[1].optimal_seconds - twins[0].optimal_seconds
    est.flops_per_chip = twins[0].flops + (L - 1) * per_layer_f
    est.seconds = twins[0].optimal_seconds + (L - 1) * per_layer_s
    if impl == "splash":
        # the compiler sees the Pallas kernel as an opaque call: add its FLOPs at peak rate
        est.kernel_flops_per_chip = attention_kernel_flops(qcfg, rows, seq_len, layout, cfg.model.remat) / mesh.size
        est.flops_per_chip += est.kernel_flops_per_chip
        est.seconds += est.kernel_flops_per_chip / target.peak_bf16_flops
        est.cost_note = ("splash attention is a Pallas kernel the cost model cannot see: its analytic FLOPs "
                         "are added, timed at the chip's peak rate (optimistic)")
    if est.seconds > 0:
        est.mfu = est.model_flops_per_chip / (est.seconds * target.peak_bf16_flops)
        slower = est.seconds + est.kernel_flops_per_chip / target.peak_bf16_flops
        est.mfu_kernel_half = est.model_flops_per_chip / (slower * target.peak_bf16_flops)
    return est


def aot_lengths(cfg: Config, spec: str = "") -> list[int]:
    """Sequence buckets to compile: `spec` ("8192,32768" or "all"), default the largest."""
    largest = bucket_length(cfg.train.max_seq_len, cfg.train.bucket_multiple)
    if spec == "all":
        lengths, n = set(), cfg.train.bucket_multiple
        while n <= cfg.train.max_seq_len:
            lengths.add(bucket_length(n, cfg.train.bucket_multiple))
            n = bucket_length(n, cfg.train.bucket_multiple) + 1
        return sorted(lengths)
    if spec:
        return [int(x) for x in spec.split(",")]
    return [largest]


def format_estimates(cfg: Config, qcfg: Qwen3Config, target: Target, estimates: list[StepEstimate],
                     mesh_sizes: dict) -> str:
    hbm = target.hbm_bytes
    head = (f"AOT train step on {target.name} ({target.chips} chips of {format_bytes(hbm)} HBM, "
            f"{target.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16 each), compiled on this host by the "
            f"{target.platform.upper()} compiler\n"
            f"model {qcfg.num_hidden_layers} layers x {qcfg.hidden_size}, params {qcfg.param_dtype}, compute "
            f"{cfg.model.dtype}, remat {cfg.model.remat}; mesh {mesh_sizes}; {update_microbatches(cfg)} microbatch(es) "
            f"an update (memory: the whole update; TFLOP/chip, est. s and MFU: one microbatch)\n")
    cols = ("rows x tokens", "attention", "result", "args", "temps", "host", "peak/chip", "HBM free",
            "TFLOP/chip", "est. s", "MFU", "compile s")
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for e in estimates:
        r = e.real
        if r.ok:
            free = 1 - r.peak_bytes / hbm
            verdict = ("fits" if free >= 1 - USABLE_MEMORY_FRACTION else
                       (f"fits (<{100 * (1 - USABLE_MEMORY_FRACTION):.0f}% free)" if free >= 0 else "OOM"))
            lines.append(" | ".join([
                r.label, e.attention, verdict, format_bytes(r.argument_bytes), format_bytes(r.temp_bytes),
                format_bytes(r.host_temp_bytes), format_bytes(r.peak_bytes), f"{100 * free:.0f}%",
                f"{e.flops_per_chip / 1e12:.4g}" if e.flops_per_chip else "-",
                f"{e.seconds:.2f}" if e.seconds else "-", f"{100 * e.mfu:.0f}%" if e.mfu else "-",
                f"{r.compile_s:.0f}"]))
        else:
            lines.append(" | ".join([r.label, e.attention, "OOM" if r.out_of_memory else "ERROR",
                                     *["-"] * 8, f"{r.compile_s:.0f}"]))
            lines.append(f"    {r.error}")
    notes = ["model TFLOP/chip (6N + attention, no recompute): "
             + ", ".join(f"{e.seq_len:,}: {e.model_flops_per_chip / 1e12:.1f}" for e in estimates)]
    notes += sorted({e.cost_note for e in estimates if e.cost_note})
    if any(e.kernel_flops_per_chip for e in estimates):
        notes.append("MFU with the attention kernel at 50% of peak instead: " + ", ".join(
            f"{e.seq_len:,}: {100 * e.mfu_kernel_half:.0f}%" for e in estimates if e.kernel_flops_per_chip))
    notes.append("est. s: the compiler's optimal_seconds for the step, layers extrapolated from 1- and "
                 "2-layer unrolled twins; MFU = model FLOPs / (est. s x peak)")
    return head + "\n".join(lines) + "\n" + "\n".join("note: " + n for n in notes)


def run_check(cfg: Config, qcfg: Qwen3Config, target_name: str, lengths_spec: str = "",
              cost: bool = True, out=print) -> bool:
    """Compile and print; True when every program compiled and its peak stays within the usable
    share of HBM (aot.targets.USABLE_MEMORY_FRACTION)."""
    from actionopd_jax.train.setup import mesh_shape

    target = get_target(target_name)
    estimates = [estimate_step(cfg, qcfg, target, n, cost=cost) for n in aot_lengths(cfg, lengths_spec)]
    out(format_estimates(cfg, qcfg, target, estimates, mesh_shape(cfg, target.chips)))
    return all(e.real.ok and e.real.peak_bytes <= USABLE_MEMORY_FRACTION * target.hbm_bytes for e in estimates)
