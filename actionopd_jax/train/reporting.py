"""Run directory, log files and metric sinks (metrics.jsonl, TensorBoard, optional W&B).

Layout of `runs/<utc>-<name>/`:
    config.yaml      the resolved config (every default filled in)
    train.log        the log of process 0
    metrics.jsonl    one JSON object per training step
    tb/              TensorBoard scalars
    checkpoints/     Orbax checkpoints
    cache/           teacher / matcher caches (when the config does not point elsewhere)
Only process 0 writes here (checkpoints are written collectively by Orbax).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def new_run_dir(root: str | Path, name: str, utc_seconds: int) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(utc_seconds))
    return Path(root) / f"{stamp}-{name}"


def latest_run_dir(root: str | Path, name: str) -> Path | None:
    """Most recent `<root>/<utc>-<name>` directory (for --resume without run.dir)."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith(f"-{name}")
                   and p.name[:15].replace("-", "").isdigit())
    return found[-1] if found else None


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record is emitted, not the stream it was at
    setup: a run started in-process (a notebook, a test) swaps stderr and closes the old one,
    and the pools' exit handlers still log after that ("I/O operation on closed file")."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(run_dir: Path | None, *, primary: bool, process_index: int = 0) -> None:
    """Process 0 logs INFO to stderr and run_dir/train.log; the others log warnings only."""
    root = logging.getLogger()
    for h in list(root.handlers):
        # ours from an earlier call, or the bare handler absl's first log line installs through
        # logging.basicConfig (it would print every record a second time)
        if getattr(h, "_actionopd", False) or type(h) is logging.StreamHandler:
            root.removeHandler(h)
    fmt = logging.Formatter(f"%(asctime)s p{process_index} %(levelname)s %(name)s: %(message)s")
    handlers: list[logging.Handler] = [_CurrentStderr()]
    if primary and run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(run_dir / "train.log"))
    for h in handlers:
        h.setFormatter(fmt)
        h._actionopd = True  # type: ignore[attr-defined]
        root.addHandler(h)
    root.setLevel(logging.INFO if primary else logging.WARNING)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class MetricsWriter:
    """Appends one record per step to metrics.jsonl and TensorBoard (and W&B if configured).
    A no-op on processes other than 0."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool = True,
                 wandb_project: str = "", run_name: str = "", config: dict | None = None):
        self.enabled = enabled
        self._tb = None
        self._wandb = None
        self._jsonl = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"))
        if wandb_project:
            try:
                import wandb  # optional dependency
            except ImportError:
                log.warning("run.wandb_project is set but wandb is not installed; logging to "
                            "TensorBoard and metrics.jsonl only")
            else:
                self._wandb = wandb.init(project=wandb_project, name=run_name, config=config,
                                         dir=str(run_dir))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
        for k, v in clean.items():
            if isinstance(v, float) and math.isfinite(v):
                if self._tb is not None:
                    self._tb.add_scalar(k, v, step)
        if self._tb is not None:
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def write_config(run_dir: Path, text: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(text)
    os.replace(tmp, run_dir / "config.yaml")
