#!/usr/bin/env python
"""Thin wrapper: `python launch/tpu_pod.py --help`; the logic is in actionopd_jax/launch/tpu_pod.py."""

import sys
from pathlib import Path

try:
    from actionopd_jax.launch.tpu_pod import main
except ModuleNotFoundError:  # running from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from actionopd_jax.launch.tpu_pod import main

if __name__ == "__main__":
    sys.exit(main())
