"""The peer frameworks' interpreters for benchmarks/sampler.py and train_step.py.

The peers (transformers, Tunix) live in their own virtual environments, outside this
repository; the user names their interpreters. Nothing here assumes where they are."""

from __future__ import annotations

import argparse
from pathlib import Path

# peer name -> (option, what its environment must hold)
PEER_OPTIONS = {
    "transformers": ("--hf-python", "torch and transformers"),
    "tunix": ("--tunix-python", "jax and google-tunix"),
}


def add_peer_args(ap: argparse.ArgumentParser) -> None:
    for name, (option, holds) in PEER_OPTIONS.items():
        ap.add_argument(option, metavar="PYTHON", default=None,
                        help=f"python of a virtual environment with {holds}, to run the {name} peer "
                             f"(e.g. VENV/bin/python); without it the {name} peer is skipped")


def peer_pythons(args: argparse.Namespace) -> dict[str, str | None]:
    """{peer: interpreter or None (not given: skipped)}; raises SystemExit with a clear
    message when a named interpreter does not exist."""
    out: dict[str, str | None] = {}
    for name, (option, holds) in PEER_OPTIONS.items():
        python = getattr(args, option.lstrip("-").replace("-", "_"))
        if python is not None and not Path(python).is_file():
            raise SystemExit(f"{option} {python}: no such file. Name the python of a virtual environment "
                             f"with {holds}, or leave {option} out to skip the {name} peer.")
        out[name] = python
    return out
