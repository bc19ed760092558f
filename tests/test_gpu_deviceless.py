"""XLA's deviceless GPU compiler (aot/gpu_topology.py): programs compiled for an H100 or H200 on
this CPU host, memory figures from XLA's own buffer assignment for the GPU.

The anchor is a device measurement: run 1 (one H200, 2026-12-04, docs/results) measured the
Qwen3-4B update at 1 x 4,096 tokens, cuDNN attention, full remat, at a peak of 66,435,741,440
bytes. The same update compiled here for the H200 must give that figure."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from actionopd_jax.aot.compile import compile_for, no_persistent_cache
from actionopd_jax.aot.gpu_topology import HOPPER, compile_devices, device_target_config, facts_for, target_config
from actionopd_jax.aot.targets import TargetUnavailable, target_devices
from actionopd_jax.model import make_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))   # device_check_work, hlo_bytes

RUN1_PEAK = 66_435_741_440   # bytes: run 1's "train qwen3-4b cudnn 4096" row, peak_bytes_in_use


def _compile_only(devices) -> bool:
    return getattr(devices[0].client, "runtime_type", "") == "compile_only_runtime"


def test_the_kinds_descriptions_and_a_compile_for_eight_h100s():
    assert facts_for("h100x8") is HOPPER["h100"] and facts_for("h200x1") is HOPPER["h200"]
    with pytest.raises(ValueError, match="no deviceless GPU description"):
        facts_for("a100x8")
    text = target_config(HOPPER["h200"])
    assert "core_count: 132" in text and 'device_description_str: "NVIDIA H200"' in text
    assert f"device_memory_size: {143_771 * 2 ** 20}" in text
    devices = compile_devices("h100x8", 8)
    assert len(devices) == 8 and _compile_only(devices)
    assert {d.device_kind for d in devices} == {"NVIDIA H100 80GB HBM3"}
    # what the device check records of a real GPU (device_check_host.describe) is taken back as is
    read_back = device_target_config(devices[:1])
    assert "core_count: 132" in read_back
    assert compile_devices("h100x1", 1, config=read_back)[0].device_kind == "NVIDIA H100 80GB HBM3"
    # an FSDP matmul over the 8 GPUs: XLA's GPU pipeline partitions it and gathers the weight
    mesh = jax.sharding.Mesh(devices, ("fsdp",))
    x = jax.ShapeDtypeStruct((8 * 128, 512), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
    w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
    report = compile_for(jax.jit(lambda a, b: a @ b), (x, w), label="fsdp matmul")
    assert report.ok, report.error
    assert report.argument_bytes == 128 * 512 * 2 + 64 * 256 * 2   # one GPU's shards
    assert report.output_bytes == 128 * 256 * 2


def test_target_devices_of_a_gpu_target_compile_without_the_gpus():
    devices = target_devices("h200x1")
    assert len(devices) == 1 and _compile_only(devices) and devices[0].device_kind == "NVIDIA H200"


def test_the_4b_update_compiled_for_the_h200_is_run_1s_measured_peak():
    """Compiled here (abstract state, nothing allocated) as the device check's first train row
    ran on the H200: XLA's figure equals the peak the device measured, within 0.5%."""
    import device_check_work as work

    from actionopd_jax.train.aot_check import update_memory
    from actionopd_jax.train.setup import model_config

    cfg = work.train_config("qwen3-4b", "cudnn", 1, 4096, 512, "full", None)
    mesh = make_mesh({"fsdp": 1}, devices=target_devices("h200x1"))
    report = update_memory(cfg, model_config(cfg), mesh)
    assert report.ok, report.error
    assert abs(report.peak_bytes / RUN1_PEAK - 1) < 0.005, (report.peak_bytes, RUN1_PEAK)


def test_without_the_plugin_registered_the_target_says_why(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "_topology_factories",
                        {k: v for k, v in xla_bridge._topology_factories.items() if k != "cuda"})
    monkeypatch.setattr(xla_bridge, "_discover_and_register_pjrt_plugins", lambda: None)
    target_devices.cache_clear()
    try:
        with pytest.raises(TargetUnavailable, match="CUDA plugin is not registered"):
            target_devices("h100x1")
    finally:
        target_devices.cache_clear()


def test_the_engines_programs_compile_for_an_h100_and_copy_on_write_copies_pages_not_the_pool():
    """The engine's three programs (tiny model, bf16, its Triton kernel) compiled by XLA:GPU.
    The decode segment's copy-on-write pass read the pool inside the scatter that writes it, and
    XLA:GPU copied the whole pool around that scatter: a temporary of one pool array (at 256 rows
    of the 4B on an H100, 20 GiB) and four pool copies a loop trip. Now its temporaries are a
    small fraction of one pool array."""
    from actionopd_jax.engine.aot import compile_engine_programs
    from actionopd_jax.engine.sizing import EngineConfig
    from actionopd_jax.model import PRESETS
    from actionopd_jax.model.runtime import RuntimeOptions

    cfg = PRESETS["tiny"]
    pages = 20_000
    one_array = pages * 16 * cfg.num_key_value_heads * cfg.head_dim * cfg.num_hidden_layers * 2   # bf16
    mesh = make_mesh({"tensor": 1}, devices=target_devices("h100x1")[:1])
    reports = compile_engine_programs(cfg, mesh, EngineConfig(slots=8, page_size=16, max_len=256, chunk=64, segment=4,
                                                              pages=pages), runtime=RuntimeOptions(dtype="bfloat16"))
    assert [r.label.split(" (")[0] for r in reports] == [
        "engine prefill chunk", "engine decode segment", "engine fresh-prompt chunk"]
    assert all(r.ok for r in reports), [r.error for r in reports]
    segment = reports[1]
    assert segment.alias_bytes == 2 * one_array          # the pool updated in place
    assert segment.temp_bytes < one_array / 20, (segment.temp_bytes, one_array)


def _copied_bytes(hlo: str) -> int:
    """Bytes written by copies in a compiled GPU program's text: copy instructions, and fusions
    whose root is a copy or a dynamic slice, synchronous or started asynchronously
    (`fusion-start`: jaxlib 0.11's form of the same slice copied out of a stacked array; its
    result is the tuple's second element, counted at the matching `fusion-done`). Read with the
    project's HLO line parser (aot/hlo_text.py) and benchmarks/hlo_bytes.py's shape sizes."""
    import re

    from actionopd_jax.aot.hlo_text import computation_header, instruction
    from hlo_bytes import _bytes as shape_bytes

    roots, found, current = {}, [], None
    for line in hlo.splitlines():
        header = computation_header(line)
        if header:
            current = header[0]
        elif (parsed := instruction(line)) is not None:
            found.append(parsed)
            if line.lstrip().startswith("ROOT "):
                roots[current] = parsed[2]
    copying = {"copy", "dynamic-slice"}
    started = {name for name, _, op, rest in found if op == "fusion-start"
               and (called := re.search(r"calls=%?([\w.\-]+)", rest)) and roots.get(called.group(1)) in copying}
    total = 0
    for _, shape, op, rest in found:
        called = re.search(r"calls=%?([\w.\-]+)", rest)
        if op == "copy" or (op == "fusion" and called and roots.get(called.group(1)) in copying):
            total += shape_bytes(shape)
        elif op == "fusion-done" and re.match(r"\(?%?([\w.\-]+)", rest).group(1) in started:
            total += shape_bytes(shape)
    return total


@pytest.mark.parametrize("sampler", ["engine", "static"])
def test_gpu_decode_reads_each_layers_weights_in_place(sampler):
    """Each decode step reads every layer's weights in place. XLA:GPU copies each scanned
    trip's slice of the stacked weights out before its matmuls (and the static sampler's slice
    of the prompt cache): jaxlib 0.10 as copy fusions, 0.11 (the lent GPUs') as asynchronous
    fusions of the same bytes. So the decode programs unroll their layers on GPU
    (decode.layer_unroll_for); with one layer a trip the copies are back, under either."""
    import functools

    from actionopd_jax.aot.lowering import cuda_stand_in
    from actionopd_jax.engine import programs
    from actionopd_jax.engine.aot import _engine_programs
    from actionopd_jax.engine.sizing import EngineConfig
    from actionopd_jax.jax_compat import set_mesh
    from actionopd_jax.model import PRESETS
    from actionopd_jax.model.runtime import RuntimeOptions
    from actionopd_jax.sampling.aot import abstract_model, compile_decode

    cfg, runtime = PRESETS["tiny"], RuntimeOptions(dtype="bfloat16")
    mesh = make_mesh({"tensor": 1}, devices=target_devices("h100x1")[:1])
    params = abstract_model(cfg.replace(param_dtype="bfloat16"), mesh, runtime)[1]
    layer_weights = sum(x.size for x in jax.tree.leaves(params)) * 2 // cfg.num_hidden_layers   # bytes, about

    def copied(unroll):
        if sampler == "static":
            compiled, _ = compile_decode(cfg.replace(param_dtype="bfloat16"), mesh, prompts=2, prompt_len=64, samples=2,
                                         max_new=8, layer_unroll=unroll, runtime=runtime)
            return _copied_bytes(compiled.as_text())
        config = EngineConfig(slots=4, page_size=16, max_len=128, chunk=64, segment=4, pages=64)
        what, jitted, args = _engine_programs(cfg, mesh, config, "paged_gpu", runtime=runtime, head="checked", cap=64,
                                              label="")[1]
        if unroll is not None:
            jitted = jax.jit(functools.partial(programs.segment, steps=config.max_segment, page_size=16, cap=64,
                                               head="checked", backend="accelerator", attention="paged_gpu",
                                               layer_unroll=unroll), static_argnums=(0,), donate_argnums=(3,))
        with cuda_stand_in(), set_mesh(mesh), no_persistent_cache():   # a compile-only target: never cached
            return _copied_bytes(jitted.lower(*args).compile().as_text())

    default = copied(None)
    assert default < layer_weights / 20, (default, layer_weights)
    scanned = copied(1)
    assert scanned > layer_weights / 4, (scanned, layer_weights)    # a trip's weights copied out of the stack
