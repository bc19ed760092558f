"""Issue 42 item 2: `model.remat: auto`'s choice confirmed by XLA's compile of the update on the
run's devices (train/remat_confirm.py). Real compiles of the tiny model's update on the CPU
backend; the usable memory is set between the policies' own compiled figures."""

from __future__ import annotations

import dataclasses
import functools

import jax
import pytest

from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import load_config
from actionopd_jax.model import make_mesh
from actionopd_jax.train.aot_check import update_memory
from actionopd_jax.train.remat_confirm import confirm_by_compile
from actionopd_jax.train.setup import model_config
from tests._configs import CONFIGS


def tiny(remat: str):
    return load_config(CONFIGS / "tiny_cpu.yaml", [
        "experiment.enabled=false", f"model.remat={remat}", "model.attention=xla", "mesh.fsdp=1",
        "train.microbatch_rows=2", "train.minibatch_rows=2", "train.max_seq_len=512", "collect.max_response_tokens=64"])


@pytest.fixture(scope="module")
def compiled():
    """Each policy's update compiled once (the CPU backend's memory analysis)."""
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    cfg = tiny("none")
    qcfg = model_config(cfg)
    reports = {p: update_memory(tiny(p), qcfg, mesh) for p in ("none", "dots", "full")}
    assert all(r.ok for r in reports.values()), {p: r.error for p, r in reports.items()}
    calls = []

    def compile_update(c, q, m):
        calls.append(c.model.remat)
        return reports[c.model.remat]
    return mesh, qcfg, reports, compile_update, calls


def test_policies_compile_to_less_memory_down_the_order(compiled):
    """What the confirmation relies on: the compiler's figure falls from none to full."""
    _, _, reports, _, _ = compiled
    peaks = [reports[p].peak_bytes for p in ("none", "dots", "full")]
    assert peaks[0] > peaks[2] > 0, peaks
    assert peaks[0] >= peaks[1] >= peaks[2], peaks


def test_a_choice_that_fits_is_kept_after_one_compile(compiled):
    mesh, qcfg, reports, compile_update, calls = compiled
    calls.clear()
    cfg, line, tried = confirm_by_compile(tiny("dots"), qcfg, mesh, attention="xla",
                                          usable_bytes=reports["dots"].peak_bytes, compile_update=compile_update)
    assert cfg.model.remat == "dots" and calls == ["dots"]
    assert [t.policy for t in tried] == ["dots"] and tried[0].xla_bytes == reports["dots"].peak_bytes
    assert "dots confirmed" in line and "over it" not in line


def test_a_choice_over_the_limit_steps_down_the_order(compiled):
    """The plan chose none; XLA says none is over by one byte: the next policy that fits runs."""
    mesh, qcfg, reports, compile_update, calls = compiled
    calls.clear()
    limit = reports["none"].peak_bytes - 1
    want = next(p for p in ("dots", "full") if reports[p].peak_bytes <= limit)
    cfg, line, tried = confirm_by_compile(tiny("none"), qcfg, mesh, attention="xla", usable_bytes=limit,
                                          compile_update=compile_update)
    assert cfg.model.remat == want
    assert calls == (["none", "dots"] if want == "dots" else ["none", "dots", "full"])
    assert tried[0].policy == "none" and tried[0].xla_bytes > limit
    assert "over it: none XLA" in line and f"{want} confirmed" in line
    assert all(t.plan_bytes > 0 for t in tried)   # each with its plan beside the compiler's figure


def test_nothing_fits_refuses_with_every_policys_figures(compiled):
    mesh, qcfg, reports, compile_update, _ = compiled
    with pytest.raises(ConfigError) as e:
        confirm_by_compile(tiny("none"), qcfg, mesh, attention="xla",
                           usable_bytes=reports["full"].peak_bytes - 1, compile_update=compile_update)
    msg = str(e.value)
    assert all(f"{p} XLA" in msg for p in ("none", "dots", "full")) and "mesh.fsdp" in msg


def test_out_of_memory_in_the_compiler_steps_down_and_other_errors_raise(compiled):
    mesh, qcfg, reports, compile_update, _ = compiled
    oom = dataclasses.replace(reports["none"], ok=False, out_of_memory=True, error="out of HBM: used 99G of 80G")
    broken = dataclasses.replace(reports["none"], ok=False, error="INVALID_ARGUMENT: something else")
    big = reports["none"].peak_bytes * 2

    def first(result, c, q, m):
        return result if c.model.remat == "none" else compile_update(c, q, m)
    cfg, _, tried = confirm_by_compile(tiny("none"), qcfg, mesh, attention="xla", usable_bytes=big,
                                       compile_update=functools.partial(first, oom))
    assert cfg.model.remat == "dots" and tried[0].xla_bytes is None and "out of HBM" in tried[0].text()
    with pytest.raises(RuntimeError, match="remat none does not compile: INVALID_ARGUMENT"):
        confirm_by_compile(tiny("none"), qcfg, mesh, attention="xla", usable_bytes=big,
                           compile_update=functools.partial(first, broken))


def test_the_run_confirms_on_accelerators_only(compiled, monkeypatch):
    """`actionopd train`'s start-up call: the CPU backend is left alone; on an accelerator (the
    backend's name patched, the program compiled by the CPU) the run's own mesh is compiled."""
    from actionopd_jax.train.remat_confirm import confirm_for_run

    _, qcfg, reports, _, _ = compiled
    cfg = tiny("none")
    limit = reports["none"].peak_bytes * 0.9
    assert confirm_for_run(cfg, qcfg, limit) == (cfg, None)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert confirm_for_run(cfg, qcfg, None) == (cfg, None)     # no known memory: nothing to hold it to
    got, line = confirm_for_run(cfg, qcfg, limit)
    assert got.model.remat in ("dots", "full") and "over it: none XLA" in line


def test_the_confirming_compile_is_loaded_by_the_runs_own_update(tmp_path):
    """Without an injected compile, the run's real update is compiled, through the persistent
    cache: a fresh TrainStep's first update of the same shapes (what the trainer builds) is a
    cache hit, not a second compile."""
    import numpy as np
    from jax._src import compilation_cache

    from actionopd_jax.train.aot_check import aot_lengths, update_shapes
    from actionopd_jax.train.batching import Row, pack_minibatch
    from actionopd_jax.train.setup import build_train_step, initial_params

    events = []

    def listen(event, **_):
        events.append(event)
    jax.monitoring.register_event_listener(listen)
    saved = {k: getattr(jax.config, k) for k in ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
                                                 "jax_persistent_cache_min_compile_time_secs",
                                                 "jax_persistent_cache_min_entry_size_bytes")}
    cfg = tiny("dots")
    qcfg = model_config(cfg)
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    try:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        compilation_cache.reset_cache()
        got, _, _ = confirm_by_compile(cfg, qcfg, mesh, attention="xla", usable_bytes=2.0**40)
        assert got.model.remat == "dots" and any(tmp_path.iterdir())
        step = build_train_step(got, qcfg, mesh)        # another step object: no in-memory reuse
        rows, seq, resp, _, _ = update_shapes(got, aot_lengths(got)[-1])
        rng = np.random.default_rng(0)
        data = [Row(rng.integers(10, qcfg.vocab_size, size=seq - resp).astype(np.int32),
                    rng.integers(10, qcfg.vocab_size, size=resp).astype(np.int32), 1.0) for _ in range(rows)]
        mb = pack_minibatch(data, list(range(rows)), microbatches=1, microbatch_rows=rows, seq_len=seq, resp_len=resp)
        state = step.init_state(initial_params(got, qcfg, mesh))
        events.clear()
        state, m = step.update(state, step.put_batch(mb.arrays))
        assert np.isfinite(float(m["loss"]))
        assert "/jax/compilation_cache/cache_hits" in events, events
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()
        from jax._src import monitoring

        getattr(monitoring, "_unregister_event_listener_by_callback", lambda _: None)(listen)
