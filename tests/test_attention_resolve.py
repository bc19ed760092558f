"""`model.attention.resolve` is the one place that refuses an attention setting, and
`RuntimeOptions` holds the execution settings apart from the model's shape (issue 22)."""

import dataclasses

import pytest

from actionopd_jax.model import PRESETS, Qwen3Config, RuntimeOptions
from actionopd_jax.model.attention import FUSED, IMPLEMENTATIONS, SharedPrefix, resolve
from actionopd_jax.model.runtime import FIELDS, split_model_dict


def test_resolve_picks_per_platform_and_refuses_in_one_place():
    assert [resolve("auto", p) for p in ("tpu", "gpu", "cpu", "rocm")] == ["splash", "cudnn", "cpu", "xla"]
    assert set(FUSED) <= set(IMPLEMENTATIONS)
    with pytest.raises(ValueError, match="expected one of"):
        resolve("flash", "cpu")
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        resolve("cudnn", "tpu")
    with pytest.raises(ValueError, match="is a TPU kernel"):
        resolve("splash", "gpu")
    layout = SharedPrefix(prompt=8, response=4, count=2)
    assert resolve("xla", "gpu", shared_prefix=layout, seq_len=16) == "xla"
    with pytest.raises(ValueError, match="shared-prefix layout of 16 tokens for rows of 20"):
        resolve("xla", "cpu", shared_prefix=layout, seq_len=20)
    with pytest.raises(ValueError, match="arbitrary masks"):
        resolve("auto", "gpu", shared_prefix=layout)
    with pytest.raises(ValueError, match="arbitrary masks"):
        resolve("cudnn", "gpu", shared_prompt=True)


def test_shape_and_execution_settings_are_separate_records():
    shape = {f.name for f in dataclasses.fields(Qwen3Config)}
    assert not shape & set(FIELDS) and set(FIELDS) == {"dtype", "remat", "attention", "scan_unroll"}
    assert RuntimeOptions().layers_per_scan_step(4) == 1 and RuntimeOptions(scan_unroll=0).layers_per_scan_step(4) == 4
    with pytest.raises(ValueError, match="attention='flash'"):
        RuntimeOptions(attention="flash")


def test_an_old_flat_model_dict_splits_into_shape_and_runtime():
    """Records written before the split held one dict with both kinds of keys."""
    tiny = PRESETS["tiny"]
    old = {**dataclasses.asdict(tiny), "dtype": "bfloat16", "remat": "full", "attention": "xla", "scan_unroll": 2}
    cfg, execution = Qwen3Config.from_dict(old)
    assert cfg == tiny
    assert RuntimeOptions(**execution) == RuntimeOptions(dtype="bfloat16", remat="full", attention="xla", scan_unroll=2)
    assert split_model_dict({"hidden_size": 8, "dtype": "float32"}) == ({"hidden_size": 8}, {"dtype": "float32"})
