"""Test-wide setup: 8 host CPU devices (for sharding tests), a persistent compile cache,
fewer GC passes, and the extended tier's mark (tests/_tiers.py).

XLA_FLAGS must be set before jax is first imported, so this happens at conftest import.
"""

import gc
import os

import pytest

from tests._subprocess_fixtures import xla_flags
from tests._tiers import extended_id

os.environ.setdefault("XLA_FLAGS", xla_flags(8))   # -O0 compiles: see _subprocess_fixtures.py
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402

_CACHE = os.environ.get(
    "ACTIONOPD_TEST_JAX_CACHE", os.path.expanduser("~/.cache/actionopd_jax/jax_test_cache")
)
# every `train`/`eval`/`serve` enables a persistent cache (actionopd_jax/compile_cache.py); in
# tests, in process and in child processes, that is the test cache, never the user's default
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

# Tracing and lowering allocate millions of short-lived objects, and each worker holds every
# test module's imports (torch, transformers, tau2, jax): Python's default GC thresholds
# (700, 10, 10: a young collection every 700 net container allocations, and full passes over
# that whole heap) cost 3.5-6% of the CPU time of compile-bound files (tests/test_train_step.py
# + 4 others: 4 min 4 s -> 3 min 57 s; docs/measurements.md). Every generation is collected
# less often, and the imports are frozen out of the full passes once collection is done.
gc.set_threshold(50_000, 20, 100)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects: the mark must be on the item by then
def pytest_collection_modifyitems(config, items):
    """The extended tier (tests/_tiers.py) gets its mark here, from the one list."""
    for item in items:
        if extended_id(item.nodeid):
            item.add_marker(pytest.mark.extended)
