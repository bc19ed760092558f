"""Keep the CUDA plugin's native start-up lines off a CPU host's terminal.

The test and cuda-lower extras install jax's CUDA plugin so that a CPU host can lower the GPU
programs (tests/test_cuda_lowering.py). Loading it on a host with no NVIDIA driver makes its
C++ side print "cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be
used.", each after absl's "WARNING: All log messages before absl::InitializeLog() is called are
written to STDERR": three times when jax is imported and again when the backends start (issue 46
item 8: six lines on every command). absl writes them to file descriptor 2 before any log level
is read, so neither TF_CPP_MIN_LOG_LEVEL nor ABSL_MIN_LOG_LEVEL stops them, and JAX_PLATFORMS=cpu
does not either (jax imports the plugin's version module at import and loads its library at
plugin discovery whatever the platforms).

`import_jax_quietly` therefore imports jax, and wraps jax's plugin discovery, with descriptor 2
pointed at a temporary file; afterwards every captured line but those two goes to the real
stderr, in order, so a genuine error printed in that window still shows. Only where it matters:
the CUDA plugin installed, no NVIDIA device on the host (a GPU host is untouched, so a real driver
or library failure there prints in full), and jax not imported yet. Lowering for CUDA is
unaffected: the plugin still loads and registers, only its lines are dropped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile

from actionopd_jax.cuda_plugin import cuda_plugin  # jax-free: this module runs before jax's import

NOISE: tuple[bytes, ...] = (b"cudart_stub.cc:", b"All log messages before absl::InitializeLog() is called")


def _has_nvidia_device() -> bool:
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def _cuda_plugin_installed() -> bool:
    return cuda_plugin() is not None


@contextlib.contextmanager
def drop_native_lines(noise: tuple[bytes, ...] = NOISE):
    """Within the block, what anything (C++ included) writes to descriptor 2 is held back; at
    its end, every held line not containing one of `noise` is written to the real descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().splitlines(keepends=True) if not any(n in line for n in noise)]
            if kept:
                os.write(2, b"".join(kept))


def import_jax_quietly() -> bool:
    """Import jax with the CUDA plugin's no-driver lines dropped, and make jax's later plugin
    discovery (at the first backend use) drop them too. True when it did so; False (nothing
    done) on a host with an NVIDIA device, without the plugin, or when jax is already imported."""
    if "jax" in sys.modules or _has_nvidia_device() or not _cuda_plugin_installed():
        return False
    with drop_native_lines():
        import jax  # noqa: F401
        from jax._src import xla_bridge
    discover = getattr(xla_bridge, "discover_pjrt_plugins", None)
    if discover is None:  # another jax: its import is quiet, its discovery untouched
        return True

    def quiet_discover(*args, **kwargs):
        with drop_native_lines():
            return discover(*args, **kwargs)

    # backends() looks the function up in its module at call time, once per process
    xla_bridge.discover_pjrt_plugins = quiet_discover
    return True
