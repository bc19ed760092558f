"""One process of the two-process resume-choice test (run as a script by tests/test_multihost.py):
joins jax.distributed on CPU, lets process 1 lag behind until process 0 has created the
checkpoint directory of a fresh run (or a few seconds have passed), then makes the command's
resume choice and opens the run's checkpointer, as `actionopd train` does. Before the choice
was taken collectively the lagging process saw the new directory, opened a read-only manager
and met its peer in a different barrier. Writes its choice as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAG_S = 8.0  # process 0 used to create the directory within a second of joining


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import jax

    from actionopd_jax.checkpoint import Checkpointer
    from actionopd_jax.commands.train_run_dir import resume_choice
    from actionopd_jax.config import Config

    jax.distributed.initialize(a.coordinator, num_processes=2, process_id=a.process_id,
                               initialization_timeout=120)
    jax.devices()  # the backend joins its peers here (the trainer's mesh does this before the choice)
    run_dir = Path(a.run_dir)
    saw_dir = False
    if a.process_id == 1:
        deadline = time.monotonic() + LAG_S
        while time.monotonic() < deadline and not (run_dir / "checkpoints").is_dir():
            time.sleep(0.05)
        saw_dir = (run_dir / "checkpoints").is_dir()
    resume, auto = resume_choice(Config(), run_dir, None)
    ckpt = Checkpointer(run_dir / "checkpoints")  # collective: what the trainer opens first
    steps = ckpt.steps()
    ckpt.close()
    Path(a.out).write_text(json.dumps({"resume": resume, "auto": auto, "steps": steps, "saw_dir": saw_dir}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
