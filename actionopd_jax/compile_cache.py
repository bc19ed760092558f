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


def off_for_cpu_cluster() -> str | None:
    """Turn the persistent cache off in a multi-process run on CPU devices; returns why (None:
    left as it was). Call after `jax.distributed.initialize`, before the first compile.

    Why: jax keys a CPU program's cache entry per process and only process 0 writes, so on a
    rerun process 0 loads its programs while every other process compiles its own. The
    processes wait for each other at the first collective anyway, so the cache saves nothing
    there, and under jax 0.12.1 that mix deadlocked in the first gloo all-reduce of a resumed
    two-process run (docs/decisions_runs.md, "jax versions"). On GPU jax leaves the device
    assignment out of the key so that every process shares an entry, and it documents shared
    entries for TPU hosts: there every process loads or every process compiles, so it stays on."""
    import jax

    if jax.process_count() < 2 or jax.default_backend() != "cpu" or not jax.config.jax_enable_compilation_cache:
        return None
    jax.config.update("jax_enable_compilation_cache", False)
    return ("persistent compile cache off: a CPU cluster's cache entries are per process, so process 0 "
            "would load programs the others compile (no time saved; jax 0.12 deadlocked on the mix)")
