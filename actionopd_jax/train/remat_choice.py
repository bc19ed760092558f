"""`model.remat: auto`: the cheapest rematerialisation policy whose planned train step fits.

Policies are tried in the order of the work their backward pass repeats (model/qwen3.py):

  none  keeps every activation: no recompute;
  dots  keeps the weight matmuls' outputs, recomputes attention and the elementwise work;
  attn  keeps each layer's input and attention residuals, recomputes the matmuls (splash only);
  full  keeps each layer's input only: the whole forward runs twice.

The first whose plan (train/plan.estimate_memory, calibrated on XLA:GPU's compile of the update,
which equals run 1's measured peak) fits the usable device memory is chosen.

"attn" is tried with splash (TPU) only: there the kernel's own residuals carry the checkpoint
name, so its backward never reruns the attention forward. cuDNN's and XLA's attention name only
their output, so the backward needs the forward again: lowered for CUDA (the 0.6B update at
1,024 tokens), "attn" has 2 cuDNN forward calls and 30 matmuls like "full" (xla attention: 37 of
full's 38), where "dots" has 2 and 24 (none: 1 and 24). On GPU "attn" is full's recompute with
more memory, never the cheaper choice (tests/test_remat_choice.py pins those counts).

"offload" (attention outputs in pinned host memory) is never chosen: its host transfers are
unmeasured on GPU and the plan counts them as free, so choosing it by memory alone would pick the
policy whose time is least known; set it explicitly to use it.

A per-layer mix (the first k layers "none", the rest "full") would fill the gap between two
adjacent policies (H200, 4B at 16,384 tokens: dots plans 99.8 GiB, none 121), but it is not cheap
in this model: the layers are one scan over parameters stacked on a leading axis under one
checkpoint policy. A `lax.cond` on the layer index inside the scan keeps the union of both
branches' residuals, stacked over every layer (the memory of "none" everywhere); two scans need the stack sliced in
two, which copies k layers' weights and concatenates their gradients inside the step (GiBs at
4B), or the parameters stored as two stacks, which changes every checkpoint's layout. Not built.

`resolve_for` is called by `actionopd train` at start-up, by `--check` and by `--check --aot`,
with the same device memory, so the run uses the policy `--check` printed, unless XLA's compile
of that policy's update on the run's accelerators puts it over the same memory: the run then
steps down the order and prints why (train/remat_confirm.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from actionopd_jax.config import Config, ConfigError
from actionopd_jax.model import Qwen3Config
from actionopd_jax.train.plan import GIB, MemoryEstimate, estimate_memory

ORDER = ("none", "dots", "attn", "full")  # least recompute first


def order_for(attention: str) -> tuple[str, ...]:
    """ORDER for this attention implementation: "attn" only where it saves the attention forward."""
    return ORDER if attention == "splash" else tuple(p for p in ORDER if p != "attn")


@dataclass(frozen=True)
class RematChoice:
    policy: str
    estimate: MemoryEstimate
    usable_bytes: float
    tried: tuple[tuple[str, float], ...]  # (policy, planned bytes) in ORDER, up to the choice

    def line(self) -> str:
        over = ", ".join(f"{p} {b / GIB:.2f} GiB" for p, b in self.tried[:-1])
        return (f"remat      auto -> {self.policy}: planned peak {self.estimate.total / GIB:.2f} GiB of "
                f"{self.usable_bytes / GIB:.2f} usable" + (f" (over it: {over})" if over else ""))


def choose_remat(cfg: Config, qcfg: Qwen3Config, mesh: dict[str, int], attention: str,
                 usable_bytes: float) -> RematChoice:
    """The first policy of order_for(attention) whose planned train step fits `usable_bytes`
    per device; ConfigError with every policy's plan when none does."""
    tried = []
    for policy in order_for(attention):
        est = estimate_memory(cfg, qcfg, mesh, attention, remat=policy)
        tried.append((policy, est.total))
        if est.total <= usable_bytes:
            return RematChoice(policy, est, usable_bytes, tuple(tried))
    full = estimate_memory(cfg, qcfg, mesh, attention, remat="full")
    plans = ", ".join(f"{p} {b / GIB:.2f} GiB" for p, b in tried)
    lighter = "bfloat16 master weights (model.param_dtype), " if qcfg.param_dtype == "float32" else ""
    raise ConfigError(
        f"model.remat=auto: no remat policy fits {usable_bytes / GIB:.2f} GiB usable per device ({plans}); "
        f"even full remat needs {full.resident / GIB:.2f} GiB of parameters, gradients and AdamW moments "
        f"plus {full.transient / GIB:.2f} GiB of activations and logits. Put more devices on mesh.fsdp, "
        f"or use {lighter}fewer train.microbatch_rows or a shorter train.max_seq_len")


def resolve_remat(cfg: Config, qcfg: Qwen3Config, mesh: dict[str, int], *, platform: str,
                  usable_bytes: float | None) -> tuple[Config, str | None]:
    """(cfg with model.remat a policy, the line saying what auto chose; None when the config
    named a policy). Without a known device memory auto cannot choose: ConfigError."""
    if cfg.model.remat != "auto":
        return cfg, None
    if not usable_bytes:
        raise ConfigError("model.remat=auto chooses by the device's memory, which is unknown here: set "
                          "mesh.device_memory_gb or mesh.target, or name a policy (none, dots, attn, full)")
    from actionopd_jax.model.attention import resolve

    choice = choose_remat(cfg, qcfg, mesh, resolve(cfg.model.attention, platform), usable_bytes)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=choice.policy)), choice.line()


def resolve_for(cfg: Config, qcfg: Qwen3Config, sizes: dict[str, int], where) -> tuple[Config, str | None]:
    """resolve_remat for a train/preflight.Placement: its usable memory, its platform. The same
    call at --check, --check --aot and the run's start-up, so the run uses what --check printed."""
    usable = where.memory_gib * where.usable_fraction * GIB if where.memory_gib else None
    return resolve_remat(cfg, qcfg, sizes, platform=where.platform, usable_bytes=usable)


def refuse_in_main_job(cfg: Config) -> None:
    """The main job's phases plan and build their own students (experiment/): auto is resolved
    for one training run only, so there a policy must be named."""
    if cfg.experiment.enabled and cfg.model.remat == "auto":
        raise ConfigError("model.remat=auto is chosen for one training run from the device's memory; the main job "
                          "(experiment.enabled=true) runs several phases: name a policy (none, dots, attn, full; "
                          "`actionopd train --check` on one phase's config prints the one auto would choose)")
