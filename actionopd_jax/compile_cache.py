"""JAX's persistent compilation cache for every `actionopd train`, `eval` and `serve`.

A 36-layer model's programs take minutes to compile; with the cache a restarted run (or a
second eval of the same shapes) loads them instead. Which directory:
  1. an explicit path (run.compile_cache_dir), "none"/"off" to leave the cache off;
  2. else one already configured (JAX_COMPILATION_CACHE_DIR, or jax.config set by the caller,
     e.g. the test suite's own cache);
  3. else DEFAULT_DIR.
Deviceless (AOT) compiles for other hardware bypass it (aot.compile.no_persistent_cache).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_DIR = "~/.cache/actionopd_jax/jax_compile"
MIN_COMPILE_SECONDS = 1.0  # programs quicker to compile than this are not worth a file


def enable_compile_cache(path: str = "") -> str | None:
    """Turn the persistent cache on (see the module docstring); returns the directory used,
    None when it stays off."""
    import jax

    choice = (path or "").strip()
    if choice.lower() in ("none", "off"):
        return None
    if not choice:
        current = os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir
        if current:
            return current
        choice = DEFAULT_DIR
    directory = Path(os.path.expanduser(choice))
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home must not stop a run: it only compiles again
        log.warning("compile cache %s not usable (%s); programs will be compiled every time", directory, e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if jax.config.jax_persistent_cache_min_compile_time_secs > MIN_COMPILE_SECONDS:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return str(directory)
