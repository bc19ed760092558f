"""config.json read as transformers reads it: RoPE settings (YaRN, absent fields) and a tied
config whose file also holds its own head, each checked by logits against transformers'
Qwen3ForCausalLM loading the same directory (tiny random checkpoints, CPU)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from actionopd_jax.model.weights import load_hf  # noqa: E402
from actionopd_jax.testing.tiny_checkpoint import make_tiny_hf_checkpoint  # noqa: E402
from tests.test_model_parity import _jax_logits, _torch_logits  # noqa: E402

# head_dim 32 and theta 1e4 put YaRN's ramp over dims 0..5 of 16 for an original context of 64
BASE = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
            rope_theta=1e4, max_position_embeddings=256)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _edit_config(ckpt, edit):
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def _batch(vocab, seed):
    """Three rows of 12 tokens at positions 0.., 70.. and 240.. (past the original context)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (3, 12)).astype(np.int32)
    mask = np.ones((3, 12), bool)
    positions = np.arange(12)[None] + np.array([[0], [70], [240]])
    return tokens, mask, positions.astype(np.int32)


def _logits(ckpt, seed=0):
    """(our config, our logits, transformers' logits) for one directory."""
    cfg, model = load_hf(ckpt)
    tokens, mask, positions = _batch(cfg.vocab_size, seed)
    ref = _torch_logits(ckpt, tokens, mask, positions, torch.float32)
    ours = np.asarray(_jax_logits(model, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(positions)))
    assert np.abs(ref).max() > 0.5, "logits too small for the tolerance to mean anything"
    return cfg, ours, ref


def _max_diff(ckpt, seed=0):
    cfg, ours, ref = _logits(ckpt, seed)
    return cfg, float(np.abs(ours - ref).max())


def _no_rope_fields(c):
    for k in ("rope_theta", "rope_parameters", "rope_scaling"):
        c.pop(k, None)


def _set(**fields):
    return lambda c: c.update(fields)


CASES = {
    # the case: default rope_parameters plus a rope_scaling YaRN entry; transformers takes
    # rope_scaling whole (its theta: none there and none at top level -> 10000)
    "default_params_plus_yarn_scaling": _set(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                             rope_scaling=dict(YARN)),
    # Qwen3's recipe: top-level theta, legacy `type` key
    "yarn_legacy_type_top_theta": _set(rope_theta=1e4, rope_parameters=None,
                                       rope_scaling={"type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64}),
    # every optional YaRN field given; a top-level original_max_position_embeddings wins
    "yarn_all_fields": _set(rope_scaling=None, original_max_position_embeddings=32,
                            rope_parameters={**YARN, "rope_theta": 5e4, "attention_factor": 1.3,
                                             "beta_fast": 16, "beta_slow": 2, "truncate": False}),
    "yarn_mscale": _set(rope_scaling={**YARN, "rope_theta": 1e4, "mscale": 0.8, "mscale_all_dim": 0.5}),
    "no_rope_fields": _no_rope_fields,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rope_settings_match_transformers(tmp_path, name):
    ckpt = make_tiny_hf_checkpoint(tmp_path / name, seed=1, init_std=0.08, **BASE)
    _edit_config(ckpt, CASES[name])
    cfg, ours, ref = _logits(ckpt)
    diff = np.abs(ours - ref).max()
    assert diff <= 1e-4, f"{name}: max abs logit diff {diff:.3g}"
    assert (cfg.rope_yarn is None) == (name == "no_rope_fields")
    if name == "no_rope_fields":
        assert cfg.rope_theta == 10000.0
    else:  # YaRN really changes the logits, so the parity above is not vacuous
        _edit_config(ckpt, lambda c: c.update(rope_scaling=None, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": cfg.rope_theta}))
        _, plain, _ = _logits(ckpt)
        assert np.abs(plain - ours).max() > 0.05


def test_yarn_config_survives_export(tmp_path):
    """to_hf_dict writes YaRN so that both we and transformers read back the same model."""
    from actionopd_jax.model.weights import save_hf

    ckpt = make_tiny_hf_checkpoint(tmp_path / "src", seed=2, init_std=0.08, **BASE)
    _edit_config(ckpt, CASES["yarn_mscale"])
    cfg, model = load_hf(ckpt)
    save_hf(model, cfg, tmp_path / "out")
    again, diff = _max_diff(tmp_path / "out", seed=3)
    assert again.rope_yarn == cfg.rope_yarn and diff <= 1e-4


@pytest.mark.parametrize("same", [False, True])
def test_tied_config_with_its_own_head(tmp_path, same):
    """transformers 5.x unties (and uses the file's head) when a tied config's file holds a
    different lm_head.weight; an identical copy stays tied."""
    assert int(transformers.__version__.split(".")[0]) >= 5
    ckpt = make_tiny_hf_checkpoint(tmp_path / "m", seed=3, init_std=0.08, **{**BASE, "tie_word_embeddings": True})
    tensors = load_file(str(ckpt / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed.copy() if same else np.random.default_rng(0).normal(
        0, 0.08, embed.shape).astype(np.float32)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    cfg, diff = _max_diff(ckpt)
    assert cfg.tie_word_embeddings == same
    assert diff <= 1e-4
