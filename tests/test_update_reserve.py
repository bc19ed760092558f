"""train/update_reserve.py: the engine's pool is sized beside the larger of the plan's and
XLA's figure for an update, and an update that does not compile stops the run before
collection (the v5p recipe's plan was 0.91x of XLA:TPU's compile: a pool sized beside the plan
left the first update after a paid collection step without memory)."""

import dataclasses

import pytest

from actionopd_jax.aot.compile import CompileReport
from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import load_config
from actionopd_jax.train.aot_check import update_memory
from actionopd_jax.train.plan import estimate_memory
from actionopd_jax.train.setup import build_mesh, model_config
from actionopd_jax.train.update_reserve import update_reserve_bytes

GIB = 1024**3


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("configs/tiny/tiny_cpu.yaml", ["experiment.enabled=false", "model.remat=full",
                                                     "train.minibatch_rows=4", "train.microbatch_rows=2",
                                                     "mesh.fsdp=2", "train.max_seq_len=512"])
    qcfg = model_config(cfg)
    mesh = build_mesh(cfg)
    est = estimate_memory(cfg, qcfg, dict(mesh.shape), "cpu")
    return cfg, qcfg, mesh, est


def _report(peak_over_resident: float, est, **kw) -> CompileReport:
    """A compile whose peak is the resident state plus `peak_over_resident` bytes."""
    return CompileReport(label="update", ok=True, argument_bytes=est.params + est.optimizer,
                         temp_bytes=peak_over_resident, **kw)


def test_the_cpu_keeps_the_plan_and_compiles_nothing(tiny):
    cfg, qcfg, mesh, est = tiny
    assert update_reserve_bytes(cfg, qcfg, mesh) == est.total - est.params - est.optimizer
    one = estimate_memory(cfg, qcfg, {}, "cpu")
    assert update_reserve_bytes(cfg, qcfg) == one.total - one.params - one.optimizer   # no mesh: one device's plan


def test_xla_figure_is_kept_where_it_is_larger_than_the_plan(tiny):
    cfg, qcfg, mesh, est = tiny
    planned = est.total - est.params - est.optimizer
    seen = []

    def compiled(extra):
        def compile_update(c, q, m):
            seen.append((c, q, m))
            return _report(extra, est)
        return compile_update

    assert update_reserve_bytes(cfg, qcfg, mesh, compile_update=compiled(planned + 5 * GIB)) == planned + 5 * GIB
    assert update_reserve_bytes(cfg, qcfg, mesh, compile_update=compiled(planned / 2)) == planned
    assert seen == [(cfg, qcfg, mesh)] * 2     # the run's own config and training mesh
    # the CPU's own compile of the update: its peak less the resident state, where above the plan
    real = update_memory(cfg, qcfg, mesh)
    assert real.ok and real.argument_bytes >= est.params + est.optimizer
    got = update_reserve_bytes(cfg, qcfg, mesh, compile_update=update_memory)
    assert got == max(planned, real.peak_bytes - est.params - est.optimizer)


def test_an_update_that_does_not_fit_stops_the_run_before_collection(tiny):
    cfg, qcfg, mesh, est = tiny
    oom = dataclasses.replace(_report(0, est), ok=False, out_of_memory=True,
                              error="RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
                                    "space hbm. Used 99.1G of 95.74G hbm.")
    with pytest.raises(ConfigError, match=r"does not fit the devices' memory on this run's devices, compiled before "
                                          r"collection: RESOURCE_EXHAUSTED.*Used 99.1G.*actionopd train --check --aot"):
        update_reserve_bytes(cfg, qcfg, mesh, compile_update=lambda c, q, m: oom)
    broken = dataclasses.replace(oom, out_of_memory=False, error="INTERNAL: ptxas exited with non-zero error code")
    with pytest.raises(ConfigError, match="does not compile on this run's devices.*ptxas"):
        update_reserve_bytes(cfg, qcfg, mesh, compile_update=lambda c, q, m: broken)


def test_check_plans_the_static_samplers_budget_beside_the_update_when_collection_is_asynchronous(capsys):
    """`train --check` for asynchronous collection with the static sampler on an accelerator:
    the budget keeps the update's reserve (the sampler's reserve_bytes), so the update beside
    collection fits where before the budget filled the memory the update needs ("DOES NOT FIT"
    whatever the config). The reserve is the fused attention's plan, not the CPU's scores."""
    import re

    from actionopd_jax.commands import train as train_cli
    from actionopd_jax.model.config import PRESETS
    from actionopd_jax.sampling.budget import SAFETY, cache_bytes_per_token

    args = ["--config", "configs/paper/qwen3_4b_h200.yaml", "--check", "collect.sampler=static"]
    budgets = {}
    for eta in (0, 1):
        assert train_cli.main(args + [f"collect.max_staleness={eta}"]) == 0
        out = capsys.readouterr().out
        budgets[eta] = int(re.search(r"token budget ([\d,]+) cache tokens", out).group(1).replace(",", ""))
    assert "peak update beside collection" in out and "-> fits" in out
    cfg = load_config("configs/paper/qwen3_4b_h200.yaml", ["collect.sampler=static", "collect.max_staleness=1",
                                                            "model.hf_path="])   # the preset, as --check planned
    qcfg = model_config(cfg)
    assert qcfg.num_hidden_layers == PRESETS["qwen3-4b"].num_hidden_layers
    est = estimate_memory(cfg, qcfg, {"data": 1, "fsdp": 1, "tensor": 1}, "cudnn")
    reserve_tokens = (est.total - est.params - est.optimizer) * SAFETY / cache_bytes_per_token(qcfg, cfg.model.dtype)
    assert abs(budgets[0] - budgets[1] - reserve_tokens) <= 1 and budgets[1] > 0, (budgets, reserve_tokens)
