"""Skips that CI turns into failures.

The lowering and AOT tests need optional packages (the CUDA plugin with cuDNN's library;
libtpu). On a developer's machine without them the tests skip. CI installs them
(`install.sh test`), and `.ci/run` exports the variables below, so a missing package or a
broken plugin there fails the run instead of silently skipping the proof."""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_CUDA = "ACTIONOPD_REQUIRE_CUDA_LOWERING"   # the CUDA lowering tests must run
REQUIRE_TPU = "ACTIONOPD_REQUIRE_TPU_AOT"          # the TPU AOT compile tests must run


def required(var: str) -> bool:
    return os.environ.get(var, "").strip() not in ("", "0", "false", "no")


def skip_or_fail(var: str, reason: str) -> None:
    """pytest.skip(reason), or a failure saying why when `var` is set."""
    if required(var):
        pytest.fail(f"{reason} -- {var} is set (CI), so this test must run: install the test extras "
                    f"(bash install.sh test) or unset {var}", pytrace=False)
    pytest.skip(reason)


def need_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        skip_or_fail(REQUIRE_TPU, "libtpu not installed (TPU AOT compilation needs it)")
