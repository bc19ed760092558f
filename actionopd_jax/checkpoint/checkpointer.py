"""Orbax checkpoints of a training run: parameters, optimizer state and a JSON record.

Layout under the checkpoint directory (one sub-directory per step, written atomically by
Orbax: a save interrupted by a crash leaves only a temporary directory that is ignored
and cleaned up):
    <step>/params     model parameters (pure dict; `actionopd export` reads only this)
    <step>/opt_state  optimizer state
    <step>/meta       JSON: step, PRNG key data, task-iterator states (one per process),
                      the run config and the model's HF config

Restores take the *target* shardings from an abstract state, so a run saved on one mesh
resumes on another mesh or device count. A step that cannot be read (corrupt or partial)
is reported and the next older step is tried.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

ITEMS = ("params", "opt_state", "meta")


class CheckpointError(RuntimeError):
    """No usable checkpoint (the message lists what was found and what to do)."""


@dataclass
class Restored:
    step: int
    params: Any
    opt_state: Any | None
    meta: dict[str, Any]


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` with the run's items and policies."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True,
                 read_only: bool = False):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    # ---- saving ----------------------------------------------------------------------------
    def save(self, step: int, state: dict, meta: dict[str, Any]) -> bool:
        """Start saving `state` ({"params", "opt_state", ...}) at `step` (async when enabled).
        Every process must call this (the save is collective)."""
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            opt_state=ocp.args.StandardSave(state["opt_state"]),
            meta=ocp.args.JsonSave(dict(meta, step=int(step))),
        )
        return self.manager.save(int(step), args=args, force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def reached_preemption(self, step: int) -> bool:
        return bool(self.manager.reached_preemption(int(step)))

    def close(self) -> None:
        self.manager.close()

    # ---- reading ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        self.manager.reload()
        return sorted(int(s) for s in self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def read_meta(self, step: int) -> dict[str, Any]:
        out = self.manager.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def restore(self, abstract_state: dict | None, step: int | None = None, *,
                params_only: bool = False) -> Restored:
        """Restore `step` (default: the latest readable one) onto the shardings of
        `abstract_state` ({"params": ..., "opt_state": ...} of ShapeDtypeStructs with
        `.sharding`; None restores as saved, on one device).

        An explicitly requested step must be readable; with step=None an unreadable latest
        step is skipped (with an error in the log) in favour of the previous one.
        """
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no finished checkpoint in {self.directory} "
                                  f"(start without --resume, or point checkpoint.dir at a run's checkpoints)")
        if step is not None:
            if int(step) not in steps:
                raise CheckpointError(f"step {step} is not in {self.directory}; available steps: {steps}")
            candidates = [int(step)]
        else:
            candidates = list(reversed(steps))
        errors = []
        for s in candidates:
            try:
                return self._restore_step(s, abstract_state, params_only)
            except Exception as e:  # noqa: BLE001 - any read failure means "this step is unusable"
                detail = str(e).splitlines()[0] if str(e) else ""
                detail = detail[:300] + ("..." if len(detail) > 300 else "")
                msg = f"checkpoint step {s} in {self.directory} is unreadable ({type(e).__name__}: {detail})"
                errors.append(msg)
                if step is not None:
                    raise CheckpointError(msg + f"; readable alternatives may be among {steps}") from e
                log.error("%s; falling back to the previous step", msg)
        raise CheckpointError("no readable checkpoint:\n  " + "\n  ".join(errors))

    def set_aside_after(self, step: int) -> list[str]:
        """Rename step directories newer than `step` (the unreadable ones a fallback skipped)
        to `<step>.unreadable-<utc>`, so the run can save those steps again; the files stay
        for inspection. Only process 0 renames; every process must call this."""
        newer = [s for s in self.steps() if s > step]
        moved = []
        if newer and jax.process_index() == 0:
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            for s in newer:
                src = self.directory / str(s)
                dst = self.directory / f"{s}.unreadable-{stamp}"
                src.rename(dst)
                moved.append(str(dst))
                log.error("set aside unreadable checkpoint %s -> %s", src, dst)
        if newer and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("actionopd_set_aside_checkpoints")
        self.manager.reload()
        return moved

    def _restore_step(self, step: int, abstract_state: dict | None, params_only: bool) -> Restored:
        def target(tree):
            return ocp.args.StandardRestore(tree) if tree is not None else ocp.args.StandardRestore()

        items = {"params": target(None if abstract_state is None else abstract_state["params"]),
                 "meta": ocp.args.JsonRestore()}
        if not params_only:
            items["opt_state"] = target(None if abstract_state is None else abstract_state["opt_state"])
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        meta = dict(out["meta"])
        if int(meta.get("step", -1)) != step:
            raise ValueError(f"meta records step {meta.get('step')} inside step directory {step}")
        _check_finite(out["params"], step)
        return Restored(step, out["params"], None if params_only else out["opt_state"], meta)


def _check_finite(params, step: int) -> None:
    """A restored checkpoint full of NaN (e.g. a run that diverged) is refused, not resumed."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        shard = leaf.addressable_data(0) if isinstance(leaf, jax.Array) else leaf
        if not np.all(np.isfinite(np.asarray(shard, dtype=np.float32))):
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} of step {step} is not finite")
