"""The persistent compile cache every `train`, `eval` and `serve` enables
(actionopd_jax/compile_cache.py): which directory, and that programs land in it."""

import jax
import jax.numpy as jnp
import pytest

from actionopd_jax import compile_cache


@pytest.fixture
def restore_jax_cache_config():
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    saved = {k: getattr(jax.config, k) for k in keys}
    yield
    for k, v in saved.items():
        jax.config.update(k, v)
    from jax._src import compilation_cache as cc

    cc.reset_cache()


def test_explicit_directory_receives_the_compiled_programs(tmp_path, restore_jax_cache_config):
    from jax._src import compilation_cache as cc

    target = tmp_path / "cc"
    assert compile_cache.enable_compile_cache(str(target)) == str(target)
    assert jax.config.jax_compilation_cache_dir == str(target)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # cache even this tiny program
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cc.reset_cache()
    jax.jit(lambda x: jnp.sin(x) * 3.25 + 0.5)(jnp.arange(7.0)).block_until_ready()
    assert [p for p in target.rglob("*") if p.is_file()], "no program was written to the cache"


def test_default_keeps_a_configured_cache_and_never_uses_home_in_tests(tmp_path, monkeypatch,
                                                                    restore_jax_cache_config):
    configured = jax.config.jax_compilation_cache_dir  # the suite's own cache (conftest.py)
    assert configured and "jax_compile" not in configured
    assert compile_cache.enable_compile_cache("") == configured
    assert jax.config.jax_compilation_cache_dir == configured
    # nothing configured anywhere: the default directory (HOME redirected here)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    jax.config.update("jax_compilation_cache_dir", None)
    used = compile_cache.enable_compile_cache("")
    assert used == str(tmp_path / ".cache" / "actionopd_jax" / "jax_compile") and (tmp_path / ".cache").is_dir()


def test_off(restore_jax_cache_config):
    before = jax.config.jax_compilation_cache_dir
    assert compile_cache.enable_compile_cache("none") is None
    assert jax.config.jax_compilation_cache_dir == before


def test_a_single_process_keeps_the_cache_and_a_cpu_cluster_turns_it_off(monkeypatch, restore_jax_cache_config):
    """compile_cache.off_for_cpu_cluster: one process (this one) is left as it was; two
    processes on CPU devices turn the cache off and say why (the real two-process run is
    tests/test_multihost.py); two processes on another platform keep it."""
    saved = jax.config.jax_enable_compilation_cache
    try:
        jax.config.update("jax_enable_compilation_cache", True)
        assert compile_cache.off_for_cpu_cluster() is None and jax.config.jax_enable_compilation_cache
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        assert compile_cache.off_for_cpu_cluster() is None and jax.config.jax_enable_compilation_cache
        monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
        note = compile_cache.off_for_cpu_cluster()
        assert note.startswith("persistent compile cache off") and not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_enable_compilation_cache", saved)
