"""`model.remat: auto`, confirmed by the compiler on the run's own devices.

The plan (train/remat_choice.py) picks the cheapest policy whose *estimated* peak fits. The
estimate is calibrated on run 1's full-remat steps (1.01-1.02x of the measured peaks there);
the other policies' estimates have no measured peak yet, and a choice can sit within a percent
of the limit: Qwen3-4B at 4,096 tokens on an 80 GB H100 plans "dots" at 70.6 GiB of 71.7 usable.
An update that does not fit fails at its first call, after the first collection step has been
paid for.

So on an accelerator the chosen policy's update is compiled at start-up against abstract state
(nothing is allocated), and XLA's memory analysis (arguments + temporaries + outputs not written
in place + code) is held to the same usable memory as the plan. Where it is over, or the
compiler itself runs out of memory, the next policy in the order is compiled, until one fits;
where none does, the run is refused with every policy's figures. The compiler's figure counts
its own buffers (library workspaces among its temporaries), not the allocator's fragmentation:
the device check records it beside the measured peak, to say how close they come.

Cost: one compile of the update at start-up, one more for each policy that does not fit. It
goes through the persistent compilation cache (`run.compile_cache_dir`), so the run's update at
its largest sequence bucket loads that program instead of compiling it again
(tests/test_remat_confirm.py: a fresh TrainStep's first update at that bucket hits the cache).
The CPU reports no memory limit and is not checked (auto needs mesh.device_memory_gb there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from actionopd_jax.config import Config, ConfigError
from actionopd_jax.model import Qwen3Config
from actionopd_jax.train.plan import GIB, estimate_memory
from actionopd_jax.train.remat_choice import order_for


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One policy's update as the compiler saw it."""

    policy: str
    plan_bytes: float           # train/plan.estimate_memory
    xla_bytes: float | None     # XLA's memory analysis; None when it did not compile
    error: str = ""

    def text(self) -> str:
        got = f"XLA {self.xla_bytes / GIB:.2f} GiB" if self.xla_bytes is not None else \
            f"does not compile ({self.error[:160]})"
        return f"{self.policy} {got} (planned {self.plan_bytes / GIB:.2f})"


def confirm_by_compile(cfg: Config, qcfg: Qwen3Config, mesh, *, attention: str, usable_bytes: float,
                       compile_update: Callable | None = None) -> tuple[Config, str, list[Compiled]]:
    """(cfg with the first policy from cfg.model.remat on, in order_for(attention), whose compiled
    update fits `usable_bytes` per device; the line saying so; every policy compiled).
    `compile_update(cfg, qcfg, mesh) -> aot.CompileReport`: train/aot_check.update_memory unless
    given. A compile error other than running out of memory is raised: every later policy would
    meet it at the run's first update too."""
    if compile_update is None:   # through the persistent cache: the run's own compile then loads it
        import functools

        from actionopd_jax.train.aot_check import update_memory
        compile_update = functools.partial(update_memory, persistent_cache=True)
    order = order_for(attention)
    if cfg.model.remat not in order:
        raise ValueError(f"confirm_by_compile: remat {cfg.model.remat!r} is not one of {order}")
    sizes = {axis: int(n) for axis, n in dict(mesh.shape).items()}
    tried: list[Compiled] = []
    for policy in order[order.index(cfg.model.remat):]:
        candidate = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=policy))
        report = compile_update(candidate, qcfg, mesh)
        plan = estimate_memory(candidate, qcfg, sizes, attention).total
        tried.append(Compiled(policy, plan, report.peak_bytes if report.ok else None, report.error))
        if report.ok and report.peak_bytes <= usable_bytes:
            over = "; ".join(t.text() for t in tried[:-1])
            line = (f"remat      {policy} confirmed by compiling it here: XLA {report.peak_bytes / GIB:.2f} GiB of "
                    f"{usable_bytes / GIB:.2f} usable (planned {plan / GIB:.2f})"
                    + (f"; over it: {over}" if over else ""))
            return candidate, line, tried
        if not report.ok and not report.out_of_memory:
            raise RuntimeError(f"the train update with remat {policy} does not compile: {report.error}")
    raise ConfigError(
        f"model.remat=auto: compiled on this host, no remat policy's update fits {usable_bytes / GIB:.2f} GiB "
        f"usable per device: {'; '.join(t.text() for t in tried)}. Put more devices on mesh.fsdp, or use "
        f"fewer train.microbatch_rows or a shorter train.max_seq_len")


def confirm_for_run(cfg: Config, qcfg: Qwen3Config, usable_bytes: float | None) -> tuple[Config, str | None]:
    """`actionopd train`'s start-up, after auto's plan chose cfg.model.remat: confirmed on this
    run's training mesh where the backend is an accelerator with a known usable memory; (cfg,
    None) unchanged elsewhere."""
    import jax

    platform = jax.default_backend()
    if platform not in ("gpu", "tpu") or not usable_bytes:
        return cfg, None
    from actionopd_jax.model.attention import resolve
    from actionopd_jax.train.setup import build_mesh

    cfg, line, _ = confirm_by_compile(cfg, qcfg, build_mesh(cfg), attention=resolve(cfg.model.attention, platform),
                                      usable_bytes=usable_bytes)
    return cfg, line
