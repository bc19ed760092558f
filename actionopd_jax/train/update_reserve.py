"""What a training update allocates beside the engine's KV pool, which stays resident.

The engine sizes its pool at the first weight load from the chips' free memory, less this
reserve (engine/sizing.py). The reserve is the update's peak less the resident parameters and
optimizer state: gradients, activations, logits and the compiler's temporaries.

The plan (train/plan.estimate_memory) gives it everywhere. On an accelerator the update is
also compiled here, before the pool exists, and XLA's figure is kept where it is larger. The
plan is calibrated on XLA:GPU's compiles (1.00-1.08x of them), but it sat at 0.91-0.93x of
XLA:TPU's for the v5p recipe (docs/measurements_compiler.md). A pool sized beside too small a
reserve leaves the first update after a collection step, whose teacher calls are paid for,
without memory. The compile goes through the persistent compilation cache, so the run's own
first update at that bucket loads it (and with `model.remat: auto` it is the program the
remat confirmation already compiled).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from actionopd_jax.config import Config, ConfigError

log = logging.getLogger(__name__)
GIB = 1024**3


def update_reserve_bytes(cfg: Config, model_config: Any, mesh: Any = None, *,
                         compile_update: Callable | None = None) -> float:
    """Bytes per chip an update allocates beyond the resident parameters and optimizer state,
    on the training `mesh` (module docstring). `compile_update(cfg, qcfg, mesh) ->
    aot.CompileReport`: on an accelerator train/aot_check.update_memory, through the cache;
    given, it runs on any platform (tests: the CPU's compile). An update that does not compile
    stops the run here, before anything is paid for: its first update would fail the same way."""
    from actionopd_jax.model.attention import resolve
    from actionopd_jax.train.plan import estimate_memory

    shape = dict(mesh.shape) if mesh is not None else {}
    platform = mesh.devices.flat[0].platform if mesh is not None else "cpu"
    est = estimate_memory(cfg, model_config, shape, resolve(cfg.model.attention, platform))
    resident, planned = est.params + est.optimizer, est.update_reserve
    if compile_update is None:
        if platform not in ("gpu", "tpu") or mesh is None:
            return planned
        from actionopd_jax.train.aot_check import update_memory

        compile_update = functools.partial(update_memory, persistent_cache=True)
    report = compile_update(cfg, model_config, mesh)
    if not report.ok:
        what = "does not fit the devices' memory" if report.out_of_memory else "does not compile"
        raise ConfigError(f"the train update (model.remat={cfg.model.remat}, train.max_seq_len="
                          f"{cfg.train.max_seq_len:,}, {cfg.train.microbatch_rows} row(s) a microbatch) {what} "
                          f"on this run's devices, compiled before collection: {report.error[:400]}. Check it with "
                          f"`actionopd train --check --aot`; model.remat=auto or full, more devices on mesh.fsdp, "
                          f"or a shorter train.max_seq_len")
    compiled = report.peak_bytes - resident
    if compiled > planned:
        log.info("update reserve beside the engine's pool: XLA's compile of the update, %.2f GiB (the plan: %.2f)",
                 compiled / GIB, planned / GIB)
    return max(planned, compiled)


__all__ = ["update_reserve_bytes"]
