"""Which of jax's CUDA plugins is installed here, asked without importing jax.

jax 0.10 ships its CUDA support as `jax_cuda12_plugin`; the GPU hosts' jax 0.11 as
`jax_cuda13_plugin`. Two places ask: `aot.lowering` (can this host lower for CUDA?) and
`commands.native_noise` (will importing jax load a plugin that prints driver noise?). The
second runs before jax's first import, so the answer must not import jax; it lives here, below
both, so a new CUDA major is added once.
"""

from __future__ import annotations

import importlib.util

# by CUDA major version, the newest first
CUDA_PLUGINS: dict[int, str] = {13: "jax_cuda13_plugin", 12: "jax_cuda12_plugin"}


def cuda_plugin() -> int | None:
    """The CUDA major version of the jax plugin installed here (None: none is)."""
    for major, module in CUDA_PLUGINS.items():
        if importlib.util.find_spec(module) is not None:
            return major
    return None
