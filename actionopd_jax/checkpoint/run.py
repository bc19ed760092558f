"""A training run's Orbax checkpoint as a model to sample from (eval, serve, generate, export).

    locate(path, step)       run dir | its checkpoints/ | one step dir  ->  RunCheckpoint
    load_model(path, ...)    the step's parameters restored straight onto the current devices

Restores name their target: abstract parameters (shape, dtype) carrying the shardings of the
*current* mesh (or the first local device), so a checkpoint written on 8 devices in a
(2, 2, 2) mesh loads on one device or on a (4, 2) mesh, and a bf16 copy is made by the
restore itself (Orbax casts while reading) rather than after a full f32 copy. The model
config and the tokenizer come from what the run recorded: the step's `meta` (model_config,
config) and `<run>/tokenizer/` (copied by the trainer at start).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from actionopd_jax.checkpoint.checkpointer import Checkpointer, CheckpointError

TMP_MARK = ".orbax-checkpoint-tmp"
TOKENIZER_DIR = "tokenizer"  # <run>/tokenizer: the trainer's copy of the run's tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")


@dataclasses.dataclass
class RunCheckpoint:
    ckpt_dir: Path          # the directory holding <step>/ folders
    run_dir: Path | None    # its parent when that looks like a run directory
    step: int | None        # the step asked for (a step folder, or --step); None = latest finished
    skipped: list[str]      # half-written step folders that were left out


def _is_step_dir(p: Path) -> bool:
    return p.is_dir() and p.name.isdigit()


def locate(path: str | Path, step: int | None = None, *, announce=print) -> RunCheckpoint:
    """Find the checkpoint folder behind `path` (a run directory, its checkpoints/ folder, or
    one step folder). Half-written steps are listed and announced, never read."""
    p = Path(path)
    run_dir = None
    if not p.exists():
        raise CheckpointError(f"{p} does not exist; pass a run directory (runs/<utc>-<name>), its "
                              "checkpoints/ folder, one step folder, or an exported HF directory")
    if TMP_MARK in p.name:
        raise CheckpointError(f"{p} is a half-written checkpoint (a save that never finished); pass the run "
                              f"directory {p.parent.parent} to use its latest finished step")
    if not p.is_dir():
        raise CheckpointError(f"{p} is a file; pass a run directory, its checkpoints/ folder or a step folder")
    if (p / "compare.json").is_file():  # `actionopd compare` output: one run per method x seed
        runs = sorted(str(c) for c in p.rglob("checkpoints") if c.is_dir())
        listed = "".join(f"\n  {Path(r).parent}" for r in runs[:12]) or " (none has checkpoints yet)"
        raise CheckpointError(f"{p} is a comparison of several runs, not one run; pass one of its per-method "
                              f"runs:{listed}")
    if _is_step_dir(p) and (p / "params").is_dir():
        picked = int(p.name)
        if step is not None and int(step) != picked:
            raise CheckpointError(f"{p} is step {picked} but --step {step} was given; pass one or the other")
        ckpt_dir, step = p.parent, picked
    elif (p / "checkpoints").is_dir():
        ckpt_dir = p / "checkpoints"
    elif _configured_dir(p) is not None:  # a run whose checkpoint.dir pointed elsewhere
        ckpt_dir, run_dir = _configured_dir(p), p
    else:
        ckpt_dir = p
    skipped = sorted(str(c) for c in ckpt_dir.iterdir() if TMP_MARK in c.name)
    for s in skipped:
        announce(f"skipping half-written checkpoint {s} (a save that did not finish)")
    finished = [c for c in ckpt_dir.iterdir() if _is_step_dir(c)]
    if not finished:
        what = "only half-written steps" if skipped else "no step folders"
        raise CheckpointError(f"{ckpt_dir} holds {what}: no finished checkpoint to load. Pass a run directory "
                              "(with checkpoints/<step>/) after at least one checkpoint was saved, or an HF "
                              "directory with config.json")
    if run_dir is None:
        parent = ckpt_dir.parent
        run_dir = parent if ckpt_dir.name == "checkpoints" or (parent / "config.yaml").is_file() else None
    return RunCheckpoint(ckpt_dir, run_dir, None if step is None else int(step), skipped)


def _configured_dir(run_dir: Path) -> Path | None:
    import yaml

    if not (run_dir / "config.yaml").is_file():
        return None
    try:
        d = ((yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("checkpoint") or {}).get("dir")
    except yaml.YAMLError:
        return None
    return Path(d) if d and Path(d).is_dir() else None


def model_config_of(meta: dict[str, Any], dtype: str | None = None):
    """The Qwen3Config (shape, parameter dtype) a step recorded; `dtype` ("float32" |
    "bfloat16") replaces the run's parameter dtype."""
    from actionopd_jax.model import Qwen3Config

    hf = meta.get("model_config")
    if not hf:
        raise CheckpointError(f"checkpoint step {meta.get('step')} has no model_config record (written by an "
                              "older trainer?); it cannot be loaded without its model shape")
    run_model = (meta.get("config") or {}).get("model") or {}
    param_dtype = dtype or run_model.get("param_dtype") or hf.get("dtype", "float32")
    return Qwen3Config.from_hf_dict(hf, param_dtype=param_dtype)


def runtime_of(meta: dict[str, Any], dtype: str | None = None):
    """RuntimeOptions to run a recorded step with: the run's compute dtype (`dtype` replaces
    it; neither: the parameter dtype). The run's remat / attention / scan_unroll are training
    choices for its own hardware, not the loader's: the defaults apply, as before the split."""
    from actionopd_jax.model.runtime import RuntimeOptions, split_model_dict

    _, execution = split_model_dict((meta.get("config") or {}).get("model") or {})
    compute = dtype or execution.get("dtype") or model_config_of(meta).param_dtype
    return RuntimeOptions(dtype=compute)


def abstract_params(qcfg, mesh=None, runtime=None):
    """(graphdef, pure-dict params of ShapeDtypeStructs with their target shardings)."""
    import jax
    from flax import nnx

    from actionopd_jax.model import Qwen3, param_shardings

    abstract = nnx.eval_shape(lambda: Qwen3(qcfg, runtime=runtime, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    shapes = nnx.to_pure_dict(state)
    if mesh is not None:
        shardings = nnx.to_pure_dict(param_shardings(state, mesh))
    else:
        single = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: single, shapes)
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    return graphdef, target


def recorded_tokenizer(found: RunCheckpoint, meta: dict[str, Any]) -> Path | None:
    """The tokenizer the run used: its copy in <run>/tokenizer, else the directory its config
    named (model.tokenizer, else model.hf_path) when that still exists."""
    if found.run_dir is not None and (found.run_dir / TOKENIZER_DIR / "tokenizer.json").is_file():
        return found.run_dir / TOKENIZER_DIR
    model = (meta.get("config") or {}).get("model") or {}
    for key in ("tokenizer", "hf_path"):
        d = model.get(key)
        if d and (Path(d) / "tokenizer.json").is_file():
            return Path(d)
    return None


def load_model(path: str | Path, *, step: int | None = None, mesh=None, dtype: str | None = None,
               announce=None, allow_unverified: bool = False):
    """(Qwen3Config, model, info) for a run's checkpoint; info = {"step", "step_dir", "ckpt_dir",
    "run_dir", "tokenizer" (Path or None), "skipped", "fallback_from" (the newer step that was
    unreadable, or None), "verified" (its files matched their checksums)}."""
    from flax import nnx

    announce = announce or (lambda line: print(line, file=sys.stderr))
    found = locate(path, step, announce=announce)
    with _quiet_absl():  # Orbax logs three warnings that a read-only manager is read-only
        ckpt = Checkpointer(found.ckpt_dir, read_only=True, allow_unverified=allow_unverified)
    try:
        steps = ckpt.steps()
        if not steps:
            raise CheckpointError(f"{found.ckpt_dir} has no finished checkpoint Orbax can read")
        if found.step is not None and found.step not in steps:
            raise CheckpointError(f"step {found.step} is not in {found.ckpt_dir}; finished steps: {steps}")
        meta, errors = None, []
        for s in [found.step] if found.step is not None else reversed(steps):
            try:
                meta = ckpt.read_meta(s)
                break
            except Exception as e:  # noqa: BLE001 - an unreadable record: report it, try an older step
                errors.append(f"step {s}: {type(e).__name__}")
                announce(f"cannot read the record of checkpoint step {s} in {found.ckpt_dir} ({type(e).__name__})")
        if meta is None:
            raise CheckpointError(f"no readable checkpoint record in {found.ckpt_dir} ({', '.join(errors)}); "
                                  f"finished steps: {steps}")
        qcfg = model_config_of(meta, dtype)
        graphdef, target = abstract_params(qcfg, mesh, runtime_of(meta, dtype))
        restored = ckpt.restore({"params": target}, found.step, params_only=True)
    finally:
        ckpt.close()
    if restored.step != int(meta["step"]):  # that step's parameters were unreadable; an older one loaded
        meta = restored.meta
        qcfg = model_config_of(meta, dtype)
    model = nnx.merge(graphdef, restored.params)
    latest = found.step if found.step is not None else steps[-1]
    info = {"step": restored.step, "step_dir": found.ckpt_dir / str(restored.step), "ckpt_dir": found.ckpt_dir,
            "run_dir": found.run_dir, "tokenizer": recorded_tokenizer(found, restored.meta),
            "skipped": found.skipped, "fallback_from": latest if restored.step != latest else None,
            "verified": restored.verified}
    return qcfg, model, info


@contextlib.contextmanager
def _quiet_absl():
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def copy_tokenizer(tokenizer_dir: str | Path | None, dst: str | Path) -> Path | None:
    """Copy a tokenizer's files (TOKENIZER_FILES, never weights) into `dst`; None, copying
    nothing, when `tokenizer_dir` holds no tokenizer.json."""
    import shutil

    if not tokenizer_dir or not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        return None
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.is_file():
            shutil.copy2(src, dst / name)
    return dst


def record_tokenizer(run_dir: str | Path, tokenizer_dir: str | Path | None) -> Path | None:
    """The run's tokenizer copied to <run>/tokenizer, so the run directory is enough to
    evaluate or serve its checkpoints later. No-op without a tokenizer directory."""
    return copy_tokenizer(tokenizer_dir, Path(run_dir) / TOKENIZER_DIR)
