"""HF safetensors load/save without torch: round trips and clear errors."""

import json
import re
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from actionopd_jax.model import Qwen3Config, make_mesh
from actionopd_jax.model.weights import checkpoint_summary, load_hf, save_hf
from actionopd_jax.testing.tiny_checkpoint import make_tiny_numpy_checkpoint


def _all_tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _state_arrays(model):
    return {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [True, False])
def test_load_export_load_is_bit_identical(tmp_path, dtype, tied):
    src = make_tiny_numpy_checkpoint(tmp_path / "src", seed=0, dtype=dtype, tie_word_embeddings=tied)
    cfg, model = load_hf(src)
    assert cfg.param_dtype == dtype and cfg.tie_word_embeddings == tied
    save_hf(model, cfg, tmp_path / "out")
    original, exported = _all_tensors(src), _all_tensors(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for name in original:
        assert exported[name].dtype == original[name].dtype, name
        # compare raw bits (bf16 included)
        assert original[name].tobytes() == exported[name].tobytes(), name
    cfg2, model2 = load_hf(tmp_path / "out")
    assert cfg2 == cfg
    a, b = _state_arrays(model), _state_arrays(model2)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def test_sharded_index_load_and_sharded_export(tmp_path):
    src = make_tiny_numpy_checkpoint(tmp_path / "src", seed=1, shard_bytes=60_000)
    assert (src / "model.safetensors.index.json").is_file() and len(list(src.glob("*.safetensors"))) > 2
    cfg, model = load_hf(src)
    single = make_tiny_numpy_checkpoint(tmp_path / "single", seed=1)
    _, model_single = load_hf(single)
    a, b = _state_arrays(model), _state_arrays(model_single)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    save_hf(model, cfg, tmp_path / "out", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    _, again = load_hf(tmp_path / "out")
    c = _state_arrays(again)
    assert all(a[k].tobytes() == c[k].tobytes() for k in a)


def test_load_onto_mesh_and_cast_dtype(tmp_path):
    src = make_tiny_numpy_checkpoint(tmp_path / "src", seed=2, dtype="bfloat16")
    cfg, model = load_hf(src, cfg_overrides={"param_dtype": "float32", "dtype": "float32"},
                         mesh=make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4]))
    assert model.layers.mlp.up_proj[...].dtype == np.float32
    assert len(model.layers.mlp.up_proj[...].sharding.device_set) == 4
    raw = _all_tensors(src)["model.layers.1.mlp.up_proj.weight"].astype(np.float32)
    np.testing.assert_array_equal(np.asarray(model.layers.mlp.up_proj[...])[1], raw.T)


def test_summary_lists_tensors(tmp_path):
    src = make_tiny_numpy_checkpoint(tmp_path / "src", seed=3)
    summary = checkpoint_summary(src)
    assert summary["model.embed_tokens.weight"]["shape"] == (256, 64)


# ---- errors -------------------------------------------------------------------------------
@pytest.fixture()
def good(tmp_path):
    return make_tiny_numpy_checkpoint(tmp_path / "good", seed=4)


def _rewrite(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_error_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory .*nope.* does not exist"):
        load_hf(tmp_path / "nope")


def test_error_missing_config(good):
    (good / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no Hugging Face config.json"):
        load_hf(good)


def test_error_missing_weights_file(good):
    (good / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights in .*expected model.safetensors"):
        load_hf(good)


def test_error_index_lists_missing_shard(tmp_path):
    src = make_tiny_numpy_checkpoint(tmp_path / "src", seed=5, shard_bytes=60_000)
    victim = sorted(src.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shard {victim.name}, which does not exist"):
        load_hf(src)


def test_error_missing_tensor(good):
    _rewrite(good, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_hf(good)


def test_error_unexpected_tensor(good):
    _rewrite(good, lambda t: t.__setitem__("model.layers.0.mlp.experts.0.weight", np.zeros((2,), np.float32)))
    with pytest.raises(ValueError, match=r"unexpected tensor.*experts\.0\.weight.*model\.safetensors"):
        load_hf(good)


def test_tied_checkpoint_may_carry_head_but_untied_must_have_it(good, tmp_path):
    tied = make_tiny_numpy_checkpoint(tmp_path / "tied", seed=7, tie_word_embeddings=True)
    _rewrite(tied, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].copy()))
    cfg, model = load_hf(tied)  # duplicate head of a tied export is ignored
    assert cfg.tie_word_embeddings and model.lm_head is None
    assert json.loads((good / "config.json").read_text())["tie_word_embeddings"] is False
    _rewrite(good, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*lm_head\.weight"):
        load_hf(good)


def test_error_shape_mismatch(good):
    _rewrite(good, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight",
                                           np.zeros((16, 64), np.float32)))
    with pytest.raises(ValueError, match=r"shape mismatch for tensor model\.layers\.0\.self_attn\.k_proj\.weight"
                                         r".*file has \(16, 64\), config.json implies \(32, 64\)"):
        load_hf(good)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3MoeForCausalLM"])
def test_error_unsupported_architecture(good, arch):
    cfg = json.loads((good / "config.json").read_text())
    cfg["architectures"] = [arch]
    (good / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"unsupported architecture.*{arch}.*only Qwen3ForCausalLM"):
        load_hf(good)


_MINIMAL = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4}


@pytest.mark.parametrize("extra, needle", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, "rope type 'longrope'"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "has no 'factor'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": -1}}, "factor=-1"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "nested per layer type"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_theta": "big"}, "rope_theta='big'"),
    ({"head_dim": None}, "a size field is null or not a number"),
])
def test_error_unsupported_rope(extra, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        Qwen3Config.from_hf_dict({**_MINIMAL, **extra})


def test_absent_fields_take_transformers_defaults():
    """What transformers' Qwen3Config assumes for fields a config.json leaves out."""
    d = {k: v for k, v in _MINIMAL.items() if k not in ("head_dim", "num_key_value_heads")}
    cfg = Qwen3Config.from_hf_dict({**d, "num_attention_heads": 32})
    assert (cfg.rope_theta, cfg.rope_yarn, cfg.head_dim, cfg.num_key_value_heads, cfg.max_position_embeddings) == (
        10000.0, None, 128, 32, 32768)
    assert Qwen3Config.from_hf_dict({**_MINIMAL, "num_key_value_heads": None}).num_key_value_heads == 2
    # a non-empty rope_scaling replaces rope_parameters whole, theta included
    cfg = Qwen3Config.from_hf_dict({**_MINIMAL, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert cfg.rope_theta == 10000.0 and cfg.rope_yarn.factor == 4.0
    assert cfg.rope_yarn.original_max_position_embeddings == 32768  # max_position_embeddings when unstated
    assert cfg.rope_yarn.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1.0)
    assert Qwen3Config.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_bf16_file_is_raw_bf16(tmp_path):
    src = make_tiny_numpy_checkpoint(tmp_path / "src", seed=6, dtype="bfloat16")
    assert _all_tensors(src)["model.norm.weight"].dtype == ml_dtypes.bfloat16
    shutil.rmtree(src)
