"""Orbax checkpoints of a training run: parameters, optimizer state and a JSON record.

Layout under the checkpoint directory (one sub-directory per step, written atomically by
Orbax: a save interrupted by a crash leaves only a temporary directory that is ignored
and cleaned up):
    <step>/params     model parameters (pure dict; `actionopd export` reads only this)
    <step>/opt_state  optimizer state
    <step>/meta       JSON: step, PRNG key data, task-iterator states (one per process),
                      the run config and the model's HF config
    <step>/checksums.json  SHA-256 of every file above (checksums.py), written once the
                      save has finished and verified before a restore reads the step

Restores take the *target* shardings from an abstract state, so a run saved on one mesh
resumes on another mesh or device count. A step that cannot be read (corrupt or partial)
is reported in one line and the next older step is tried; a step whose files do not match
its checksums counts as unreadable.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from actionopd_jax.checkpoint.checksums import MANIFEST, verify, write_manifest

log = logging.getLogger(__name__)

ITEMS = ("params", "opt_state", "meta")


class CheckpointError(RuntimeError):
    """No usable checkpoint (the message lists what was found and what to do)."""


class UnverifiedCheckpoint(ValueError):
    """A step without a checksum manifest, refused unless allow_unverified."""


@dataclass
class Restored:
    step: int
    params: Any
    opt_state: Any | None
    meta: dict[str, Any]
    verified: bool = False  # its files matched the step's checksum manifest


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` with the run's items and policies."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True,
                 read_only: bool = False, allow_unverified: bool = False):
        self.directory = Path(directory).absolute()
        # a step without a checksum manifest cannot be checked: refused (as unreadable, so a
        # restore of the latest step falls back to a verified one) unless the user says so
        self.allow_unverified = allow_unverified
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self._unrecorded: list[int] = []  # steps this process saved whose checksums are not written yet

    # ---- saving ----------------------------------------------------------------------------
    def save(self, step: int, state: dict, meta: dict[str, Any]) -> bool:
        """Start saving `state` ({"params", "opt_state", ...}) at `step` (async when enabled).
        Every process must call this (the save is collective)."""
        self.wait()  # the previous step is final: record its checksums before the next save starts
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            opt_state=ocp.args.StandardSave(state["opt_state"]),
            meta=ocp.args.JsonSave(dict(meta, step=int(step))),
        )
        saved = self.manager.save(int(step), args=args, force=True)
        if saved:
            self._unrecorded.append(int(step))
        return saved

    def wait(self) -> None:
        """Wait for the save in flight, then write the checksum manifest of every step this
        checkpointer saved (process 0; the step folders are final by then)."""
        self.manager.wait_until_finished()
        steps, self._unrecorded = self._unrecorded, []
        if jax.process_index() == 0:
            for s in steps:
                if (self.directory / str(s)).is_dir():  # max_to_keep may have removed it already
                    write_manifest(self.directory / str(s))

    def record_finished(self) -> None:
        """Write the checksum manifests of saves that have finished, without waiting for one in
        flight. The loop calls it every step: a run killed after a save finished but before the
        next one started then resumes from that save, not the verified one before it."""
        if self._unrecorded and not self.manager.is_saving_in_progress():
            self.wait()   # nothing in flight: returns at once (per process, no collective)

    def reached_preemption(self, step: int) -> bool:
        return bool(self.manager.reached_preemption(int(step)))

    def close(self) -> None:
        self.wait()
        # Orbax removes a crashed save's temporary folders in a background thread that its own
        # close() does not join: a checkpointer opened next on this folder (a resume in the same
        # process) would start a second removal of the same folders and one of them fails.
        await_cleanup = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:
            await_cleanup()
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
                    others = [x for x in steps if x != s]
                    hint = (f"; the other finished steps are {others} (pass one of them, or the run directory "
                            f"to load the latest readable one)" if others else "; it is the only finished step")
                    raise CheckpointError(msg + hint) from None
                earlier = [x for x in candidates if x < s]
                log.error("%s; %s", msg, f"falling back to step {earlier[0]}" if earlier else "no earlier step is left")
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
        verified = verify(self.directory / str(step), tuple(items))  # raises on damage, before Orbax reads
        if not verified and not self.allow_unverified:
            raise UnverifiedCheckpoint(
                f"it has no checksum manifest ({MANIFEST}), so its files cannot be checked: it was saved before "
                "manifests were recorded, or its save stopped before the manifest was written. Pass "
                "--allow-unverified to load it anyway (the scores record verified: false)")
        if not verified:
            log.warning("checkpoint step %d in %s has no checksum manifest (saved before they were recorded): "
                        "loading it unverified, as --allow-unverified asked", step, self.directory)
        with _orbax_read_errors_quiet():
            out = self.manager.restore(step, args=ocp.args.Composite(**items))
        meta = dict(out["meta"])
        if int(meta.get("step", -1)) != step:
            raise ValueError(f"meta records step {meta.get('step')} inside step directory {step}")
        _check_finite(out["params"], step)
        return Restored(step, out["params"], None if params_only else out["opt_state"], meta, verified)


def _from_orbax(unraisable) -> bool:
    """An unraisable exception left by one of Orbax's array reads: raised in Orbax code, or
    the read coroutine itself."""
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
        return True
    tb = unraisable.exc_traceback
    while tb is not None:
        if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _only_asyncio(tb) -> bool:
    seen = False
    while tb is not None:
        if f"{os.sep}asyncio{os.sep}" not in tb.tb_frame.f_code.co_filename:
            return False
        seen, tb = True, tb.tb_next
    return seen


_NOISE_FILTER_ON = False


def _drop_orbax_read_noise() -> None:
    """A damaged step makes every array read of Orbax's restore fail; the first failure is the
    one restore() reports (once), the others surface as 'Exception ignored in <coroutine ...>'
    tracebacks whenever the abandoned read coroutines are collected, and as 'Event loop is
    closed' from reads finishing after Orbax closed its loop. From the first restore on, those
    (and only those) are dropped; anything else still reaches the previous hooks."""
    global _NOISE_FILTER_ON
    if _NOISE_FILTER_ON:
        return
    previous, previous_except = sys.unraisablehook, sys.excepthook

    def closed_loop(kind, value, tb) -> bool:
        # a read that completes after Orbax closed its event loop reports the closed loop
        # from TensorStore's thread: a traceback of asyncio frames only
        return kind is RuntimeError and str(value) == "Event loop is closed" and _only_asyncio(tb)

    def hook(unraisable):
        if not (_from_orbax(unraisable) or closed_loop(unraisable.exc_type, unraisable.exc_value,
                                                       unraisable.exc_traceback)):
            previous(unraisable)

    def excepthook(kind, value, tb):
        if not closed_loop(kind, value, tb):
            previous_except(kind, value, tb)

    sys.unraisablehook, sys.excepthook = hook, excepthook
    # a read *task* collected with its failure unretrieved is reported by asyncio's exception
    # handler through the "asyncio" logger ("Task exception was never retrieved"), not by the
    # unraisable hook; which of the two reports a read depends on timing
    logging.getLogger("asyncio").addFilter(_OrbaxReadRecords())
    _NOISE_FILTER_ON = True


class _OrbaxReadRecords(logging.Filter):
    """Drops asyncio's log records of a failed Orbax read task (its traceback runs through Orbax)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info
        if not exc or exc[2] is None:
            return True
        tb = exc[2]
        while tb is not None:
            if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
                return False
            tb = tb.tb_next
        return True


@contextlib.contextmanager
def _orbax_read_errors_quiet():
    _drop_orbax_read_noise()  # before the read: the noise starts while it fails
    try:
        yield
    except Exception:
        gc.collect()  # most abandoned reads are collected now, through the filter
        raise


def _check_finite(params, step: int) -> None:
    """A restored checkpoint full of NaN (e.g. a run that diverged) is refused, not resumed."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        shard = leaf.addressable_data(0) if isinstance(leaf, jax.Array) else leaf
        if not np.all(np.isfinite(np.asarray(shard, dtype=np.float32))):
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} of step {step} is not finite")
