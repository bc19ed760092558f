"""Ahead-of-time compilation for hardware this machine does not have.

`targets` names the accelerators a run can be planned for (TPU slices by their public names,
GPUs), `compile` compiles a jitted program for one of them and reads the compiler's own
memory and cost numbers. With `libtpu` installed (the `tpu` extra), a CPU host compiles for
any TPU topology: out-of-memory and lowering errors are the TPU compiler's.
"""

from actionopd_jax.aot.compile import CompileReport, compile_for, format_bytes
from actionopd_jax.aot.targets import TARGETS, Target, get_target, target_devices

__all__ = ["CompileReport", "TARGETS", "Target", "compile_for", "format_bytes", "get_target", "target_devices"]
