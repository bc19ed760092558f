"""The few jax APIs whose names moved between the releases we run on: the CPU hosts' and CI's
jax (0.10) and the GPU hosts' preinstalled 0.11 (on Python 3.12; BUILD_NOTES.md, "Test", says
how to run the suite under it here).

Every use of them in the package goes through this module, so a rename in a new release is
fixed in one place, and a failure names the jax version and what was looked for.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import jax


def set_mesh(mesh):
    """The ambient-mesh context manager: `jax.set_mesh` (older releases: `jax.sharding.use_mesh`)."""
    fn = getattr(jax, "set_mesh", None) or getattr(jax.sharding, "use_mesh", None)
    if fn is None:
        raise RuntimeError(f"jax {jax.__version__} has neither jax.set_mesh nor jax.sharding.use_mesh")
    return fn(mesh)


def shard_map(f, *, mesh, in_specs, out_specs):
    """`jax.shard_map` without the replication check (our kernels' outputs are per-shard by
    construction): `check_vma=False`, or `check_rep=False` where the release still spells it so."""
    fn = getattr(jax, "shard_map", None)
    if fn is None:  # releases before shard_map left jax.experimental
        from jax.experimental.shard_map import shard_map as fn
    try:
        return fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except TypeError as e:
        if "check_vma" not in str(e):
            raise
        return fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


# where each release keeps the Pallas kernels we call (first match wins)
_KERNELS = {
    "gpu_paged_attention": ("jax.experimental.pallas.ops.gpu.paged_attention:paged_attention",),
}


@functools.cache   # asked at every trace of a GPU decode; a missing module would be searched again each time
def has_pallas_kernel(name: str) -> bool:
    """Whether this jax has the Pallas kernel `name` (`_KERNELS`) anywhere we look."""
    try:
        pallas_kernel(name)
    except ImportError:
        return False
    return True


def pallas_kernel(name: str):
    """A Pallas kernel function by our name (`_KERNELS`); ImportError naming jax's version and
    every place looked in when none has it."""
    tried = []
    for where in _KERNELS[name]:
        module, attr = where.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            tried.append(f"{where} ({type(e).__name__}: {e})")
    raise ImportError(f"jax {jax.__version__}: no Pallas kernel {name!r}; looked in " + "; ".join(tried))


@contextlib.contextmanager
def triton_lowers_on_cpu_as(version: str = "H100"):
    """Within: Pallas Triton kernels lower for CUDA on a host whose default device is a CPU, as
    for GPU `version` (a name of jax's GpuVersion). jax 0.11 asks the default device (or the
    abstract mesh's) for its compute capability and refuses a CPU one ("No supported GPU
    devices found"); it looks a kind it does not know up in its registry, where this puts
    "cpu" for the block. jax 0.10 assumed sm_90 itself: nothing to do there."""
    try:   # the module the lowering itself asks (jax 0.11: pallas.triton.gpu_info; 0.12: jax._src.gpu_info)
        from jax._src.pallas.triton import pallas_call_registration

        gpu_info = pallas_call_registration.gpu_info_lib
    except (ImportError, AttributeError):
        yield
        return
    added = "cpu" not in gpu_info.registry
    if added:
        gpu_info.registry["cpu"] = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion[version])
    try:
        yield
    finally:
        if added:
            gpu_info.registry.pop("cpu", None)
            getattr(gpu_info.get_gpu_info, "cache_clear", lambda: None)()   # no stand-in answer kept


__all__ = ["has_pallas_kernel", "pallas_kernel", "triton_lowers_on_cpu_as", "set_mesh", "shard_map"]
