"""A run written before the issue-22 restructuring still loads (tests/data/pre_restructure_run/).

The run was written by commit 6adbb28 (before the restructuring) with
    cd <tree at 6adbb28> && PYTHONPATH=$PWD JAX_PLATFORMS=cpu \
        python tests/data/pre_restructure_run/make_run.py tests/data/pre_restructure_run/run
(the script is kept next to it): one step of the real Trainer and Orbax Checkpointer on one CPU
device, compute dtype bfloat16 over float32 parameters, then the same old code's load_model
recorded per-parameter sums and a forward's logits on fixed tokens in reference.json. Here the
current run loading (what eval and serve use) reads that run: the shape from the checkpoint's
model_config record, the execution settings (compute dtype) from its run config, and the same
parameters and logits come back.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from actionopd_jax.checkpoint import CheckpointError
from actionopd_jax.checkpoint.run import load_model

DATA = Path(__file__).parent / "data" / "pre_restructure_run"


def _load(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(DATA / "run", run)  # Orbax may write beside what it reads: keep the data pristine
    with pytest.raises(CheckpointError, match="no checksum manifest"):   # refused by default (issue 34)
        load_model(run)
    return (*load_model(run, allow_unverified=True), json.loads((DATA / "reference.json").read_text()))


def _compute_dtype(model) -> str:
    runtime = getattr(model, "runtime", None)
    return (runtime if runtime is not None else model.cfg).dtype


def test_pre_restructure_run_loads_with_its_parameters_and_logits(tmp_path):
    qcfg, model, info, ref = _load(tmp_path)
    assert ref["commit"].startswith("6adbb28")
    assert info["step"] == ref["step"] == 1
    assert info["tokenizer"] is not None and (info["tokenizer"] / "tokenizer.json").is_file()
    # written before checksum manifests existed: it loads when allowed, reported unverified (issue 26)
    assert info["verified"] is False and info["fallback_from"] is None
    assert qcfg.param_dtype == ref["param_dtype"] and _compute_dtype(model) == ref["compute_dtype"]

    flat = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    got = {"/".join(str(getattr(k, "key", k)) for k in path): x
           for path, x in jax.tree_util.tree_flatten_with_path(flat)[0]}
    assert sorted(got) == sorted(ref["param_sums"])
    for name, (total, abs_total, shape, dtype) in ref["param_sums"].items():
        x = np.asarray(got[name], np.float64)
        assert list(x.shape) == shape and str(np.asarray(got[name]).dtype) == dtype, name
        assert x.sum() == total and np.abs(x).sum() == abs_total, name

    tokens = jnp.asarray(ref["tokens"], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = model(tokens, positions)
    logits = np.asarray(model.logits(hidden), np.float32)
    head = np.asarray(ref["logits_head"], np.float32)
    np.testing.assert_array_equal(logits[..., :head.shape[-1]], head)
    np.testing.assert_array_equal(np.asarray(logits, np.float64).sum(-1), np.asarray(ref["logits_sums"]))
