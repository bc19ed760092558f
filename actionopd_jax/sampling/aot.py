"""Ahead-of-time compilation of the sampler's real programs for a target the host does not have.

`compile_sampler_programs` lowers and compiles exactly what `Sampler` compiles (the same
functions, static arguments and donation) for abstract parameters and inputs on a mesh built
from a topology's devices, e.g. a TPU v5p-8 described by libtpu on a CPU machine:

    mesh = tpu_mesh(v5p_topology("v5p:2x2x1"), {"tensor": 4})   # libtpu's devices, no chips
    programs = compile_sampler_programs(cfg, mesh, prompts=16, prompt_len=4096, samples=4, max_new=4096)
    programs.decode.memory_analysis()

Nothing is executed; memory and lowering errors are the target compiler's own.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from actionopd_jax.aot.compile import no_persistent_cache
from actionopd_jax.aot.lowering import LoweringReport, lower_for, lowering_for
from actionopd_jax.aot.targets import topology_devices
from actionopd_jax.model import Qwen3
from actionopd_jax.model.config import Qwen3Config
from actionopd_jax.model.sharding import logical_to_spec, make_mesh, param_shardings
import actionopd_jax.sampling.decode as decode_lib
from actionopd_jax.sampling.buckets import Buckets
from actionopd_jax.sampling.token_choice import DEFAULT_CAP
from actionopd_jax.jax_compat import set_mesh

GIB = 2 ** 30


@dataclasses.dataclass
class AotPrograms:
    prefill: Any            # jax.stages.Compiled
    decode: Any
    prefill_seconds: float  # lower + compile, this host
    decode_seconds: float


def target_platform(mesh) -> str:
    """The platform a program traced under `mesh` is compiled for ("tpu", "gpu", "cpu")."""
    return mesh.devices.flat[0].platform


def tpu_mesh(devices, shape: dict[str, int]):
    """A sampler mesh (data, fsdp, tensor; Auto axes) over a topology's devices."""
    return make_mesh(shape, devices=list(devices))


def _sds(shape, dtype, mesh, logical=None) -> jax.ShapeDtypeStruct:
    spec = logical_to_spec(logical, mesh, shape=shape) if logical else PartitionSpec()
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def abstract_model(cfg: Qwen3Config, mesh, runtime=None):
    """(graphdef, abstract parameter state with the model's shardings on `mesh`); runtime: the
    model's RuntimeOptions (None: the defaults)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, runtime=runtime, rngs=nnx.Rngs(0))))
    shardings = param_shardings(state, mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    return graphdef, abstract


def abstract_inputs(mesh, *, prompts: int, prompt_len: int, samples: int):
    """(prompt tokens, prompt mask, RowSettings, end ids) as sharded ShapeDtypeStructs: the
    shardings the Sampler's host arrays take on `mesh` (rows over data/fsdp)."""
    rows = prompts * samples
    key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
    row_settings = decode_lib.RowSettings(
        keys=_sds((rows,), key_dtype, mesh, ("batch",)), temperature=_sds((rows,), jnp.float32, mesh, ("batch",)),
        top_k=_sds((rows,), jnp.int32, mesh, ("batch",)), top_p=_sds((rows,), jnp.float32, mesh, ("batch",)),
        max_new=_sds((rows,), jnp.int32, mesh, ("batch",)))
    tokens = _sds((prompts, prompt_len), jnp.int32, mesh, ("batch", "length"))
    mask = _sds((prompts, prompt_len), jnp.bool_, mesh, ("batch", "length"))
    return tokens, mask, row_settings, _sds((2,), jnp.int32, mesh)


def _prefill_fn(samples, max_new, cap, head, span_ladder):
    return jax.jit(functools.partial(decode_lib.prefill, samples=samples, max_new=max_new, cap=cap, head=head,
                                     span_ladder=span_ladder), static_argnums=(0,))


def _decode_fn(cap, head, layer_unroll=None):
    return jax.jit(functools.partial(decode_lib.decode, cap=cap, head=head, layer_unroll=layer_unroll),
                   static_argnums=(0,), donate_argnums=(2,))


def compile_sampler_programs(cfg: Qwen3Config, mesh, *, prompts: int, prompt_len: int, samples: int,
                             max_new: int, cap: int = DEFAULT_CAP, head: str = "checked",
                             span_ladder: tuple[int, ...] | None = None, runtime=None) -> AotPrograms:
    """AOT-compile the Sampler's prefill and decode programs for one bucket on `mesh`.
    Inputs get the shardings the Sampler's host arrays would take there (rows over
    data/fsdp); decode's state takes prefill's output shardings."""
    span_ladder = Buckets().attention_spans if span_ladder is None else span_ladder
    graphdef, params = abstract_model(cfg, mesh, runtime)
    tokens, mask, row_settings, end_ids = abstract_inputs(mesh, prompts=prompts, prompt_len=prompt_len,
                                                          samples=samples)
    with set_mesh(mesh), no_persistent_cache():
        t0 = time.perf_counter()
        prefill = _prefill_fn(samples, max_new, cap, head, span_ladder)
        prefill_c = prefill.lower(graphdef, params, tokens, mask, row_settings, end_ids).compile()
        t1 = time.perf_counter()
        out_shapes = jax.eval_shape(prefill, graphdef, params, tokens, mask, row_settings, end_ids)
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             out_shapes, prefill_c.output_shardings)
        checked = None  # the CPU backend's "checked" head (if it applies) is then built inside decode
        t2 = time.perf_counter()
        decode_c = _decode_fn(cap, head).lower(graphdef, params, state, row_settings, end_ids, checked).compile()
        t3 = time.perf_counter()
    return AotPrograms(prefill=prefill_c, decode=decode_c, prefill_seconds=t1 - t0, decode_seconds=t3 - t2)


def compile_decode(cfg: Qwen3Config, mesh, *, prompts: int, prompt_len: int, samples: int, max_new: int,
                   cap: int = DEFAULT_CAP, head: str = "checked", layer_unroll: int | None = None, runtime=None):
    """AOT-compile the Sampler's decode program alone (prefill is only traced for the state's
    shapes; the state takes decode.state_shardings). Returns (compiled, seconds)."""
    graphdef, params = abstract_model(cfg, mesh, runtime)
    tokens, mask, row_settings, end_ids = abstract_inputs(mesh, prompts=prompts, prompt_len=prompt_len,
                                                          samples=samples)
    with set_mesh(mesh), no_persistent_cache():
        prefill = _prefill_fn(samples, max_new, cap, head, ())
        shapes = jax.eval_shape(prefill, graphdef, params, tokens, mask, row_settings, end_ids)
        shardings = decode_lib.state_shardings(shapes, mesh)
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
        t0 = time.perf_counter()
        compiled = _decode_fn(cap, head, layer_unroll).lower(graphdef, params, state, row_settings, end_ids,
                                                             None).compile()
        return compiled, time.perf_counter() - t0


def lower_sampler_programs(cfg: Qwen3Config, mesh, *, prompts: int, prompt_len: int, samples: int, max_new: int,
                           cap: int = DEFAULT_CAP, head: str = "checked", runtime=None, platform: str = "cuda",
                           label: str = "") -> list[LoweringReport]:
    """Lower the Sampler's prefill and decode programs for `platform` (no compile), traced for
    it over `mesh` (on a CPU host: stand-in devices, `aot.lowering`). Parameters in bfloat16,
    the accelerators' rollout copy (sampling/rollout.py); decode's state takes
    decode.state_shardings, as `compile_decode`."""
    traced_for = "gpu" if platform in ("cuda", "rocm") else platform
    graphdef, params = abstract_model(cfg.replace(param_dtype="bfloat16"), mesh, runtime)
    tokens, mask, row_settings, end_ids = abstract_inputs(mesh, prompts=prompts, prompt_len=prompt_len,
                                                          samples=samples)
    shape = label or f"{prompts} x {prompt_len:,} prompt, {samples} x {max_new:,} new"
    prefill = _prefill_fn(samples, max_new, cap, head, ())
    args = (graphdef, params, tokens, mask, row_settings, end_ids)
    reports = [lower_for(prefill, args, label=f"sampler prefill ({shape})", platform=platform, mesh=mesh,
                         traced_for=traced_for)]
    try:
        with lowering_for(traced_for), set_mesh(mesh):
            shapes = jax.eval_shape(prefill, *args)
            shardings = decode_lib.state_shardings(shapes, mesh)
    except Exception as e:  # noqa: BLE001 - prefill's report already holds the error
        return reports + [LoweringReport(label=f"sampler decode ({shape})", platform=platform,
                                         error=f"prefill did not trace: {type(e).__name__}")]
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    reports.append(lower_for(_decode_fn(cap, head), (graphdef, params, state, row_settings, end_ids, None),
                             label=f"sampler decode ({shape})", platform=platform, mesh=mesh, traced_for=traced_for))
    return reports


def memory_gib(compiled) -> dict[str, float]:
    """Per-device memory of a compiled program (GiB): arguments, outputs, temporaries, the
    aliased (donated) bytes, and peak = args + outputs + temps - aliased (+ generated code)."""
    m = compiled.memory_analysis()
    args, out, temp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
    alias = m.alias_size_in_bytes
    code = getattr(m, "generated_code_size_in_bytes", 0)
    peak = getattr(m, "peak_memory_in_bytes", 0) or (args + out + temp - alias + code)
    return {"args": args / GIB, "out": out / GIB, "temp": temp / GIB, "alias": alias / GIB,
            "peak": peak / GIB}


def v5p_topology(name: str = "v5p:2x2x1"):
    """The devices of a TPU topology from libtpu (raises when libtpu is not installed)."""
    return topology_devices(name)


__all__ = ["AotPrograms", "abstract_inputs", "abstract_model", "compile_decode", "compile_sampler_programs",
           "lower_sampler_programs", "memory_gib", "target_platform", "tpu_mesh", "v5p_topology"]
