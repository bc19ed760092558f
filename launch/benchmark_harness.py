#!/usr/bin/env python
"""Entry point: `python launch/benchmark_harness.py --help`. The logic is in actionopd_jax/launch/harness.py (installed
with the package, importable by tests); this script only makes a plain checkout runnable."""

import sys
from pathlib import Path

try:
    from actionopd_jax.launch.harness import main
except ModuleNotFoundError:  # running from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from actionopd_jax.launch.harness import main

if __name__ == "__main__":
    sys.exit(main())
