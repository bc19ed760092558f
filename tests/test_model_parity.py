"""Logits parity of our Flax Qwen3 against transformers' PyTorch Qwen3ForCausalLM (CPU).

Each checkpoint is random (weights and norm scales) and built locally through transformers.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from actionopd_jax.model import left_pad_positions  # noqa: E402
from actionopd_jax.model.weights import load_hf, save_hf  # noqa: E402
from actionopd_jax.testing.tiny_checkpoint import make_tiny_hf_checkpoint  # noqa: E402

CONFIGS = {
    # 4 query heads share 1 KV head, tied embeddings, large rope theta
    "gqa4_tied": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                      rope_theta=1e6),
    # 2 groups, untied, head_dim larger than hidden/heads
    "gqa2_untied_hd32": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             tie_word_embeddings=False, rope_theta=1e4),
    # plain multi-head (no sharing), 3 layers, small head_dim and odd vocab
    "mha_hd8": dict(num_attention_heads=6, num_key_value_heads=6, head_dim=8, hidden_size=48,
                    intermediate_size=96, num_hidden_layers=3, vocab_size=301, tie_word_embeddings=False,
                    rope_theta=5e5),
}


def _batch(vocab, seed=0):
    """Left-padded batch: row 0 full, row 1 with 3 pads, row 2 with 6 pads."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (3, 11)).astype(np.int32)
    mask = np.ones((3, 11), bool)
    mask[1, :3] = False
    mask[2, :6] = False
    positions = np.asarray(left_pad_positions(jnp.asarray(mask)))
    return tokens, mask, positions


def _torch_logits(model_dir, tokens, mask, positions, dtype):
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(mask.astype(np.int64)),
                 position_ids=torch.tensor(positions, dtype=torch.long))
    return out.logits.float().numpy()


@nnx.jit
def _jax_logits(model, tokens, mask, positions):
    hidden, _ = model(tokens, positions, attention_mask=mask)
    return model.logits(hidden)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_f32_logits_match_transformers(tmp_path, name):
    overrides = CONFIGS[name]
    ckpt = make_tiny_hf_checkpoint(tmp_path / name, seed=1, init_std=0.08, **overrides)
    cfg, model = load_hf(ckpt)
    assert cfg.num_key_value_heads == overrides["num_key_value_heads"]
    assert cfg.tie_word_embeddings == overrides["tie_word_embeddings"]
    assert cfg.rope_theta == overrides["rope_theta"]
    tokens, mask, positions = _batch(cfg.vocab_size)
    ref = _torch_logits(ckpt, tokens, mask, positions, torch.float32)
    ours = np.asarray(_jax_logits(model, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(positions)))
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    diff = np.abs(ours - ref)[mask]  # padded positions are garbage on both sides
    assert np.abs(ref).max() > 0.5, "logits too small for the tolerance to mean anything"
    assert diff.max() <= 1e-4, f"{name}: max abs diff {diff.max():.3g}"


def test_padding_does_not_change_real_positions(tmp_path):
    """A row's logits do not depend on how much left padding precedes it."""
    ckpt = make_tiny_hf_checkpoint(tmp_path / "m", seed=2, init_std=0.08, **CONFIGS["gqa4_tied"])
    _, model = load_hf(ckpt)
    tokens, mask, positions = _batch(256, seed=3)
    padded = np.asarray(_jax_logits(model, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(positions)))
    row = tokens[2:3, 6:]
    alone = np.asarray(_jax_logits(model, jnp.asarray(row), jnp.ones(row.shape, bool),
                                   jnp.arange(row.shape[1])[None]))
    np.testing.assert_allclose(padded[2, 6:], alone[0], atol=1e-5)


def test_bf16_logits_within_stated_tolerance(tmp_path):
    """bf16 params + bf16 compute: error vs the f32 reference is at most 2x PyTorch's own bf16 error
    (plus 0.02 absolute) and below 5% of the logit range."""
    overrides = CONFIGS["gqa2_untied_hd32"]
    ckpt = make_tiny_hf_checkpoint(tmp_path / "bf16", seed=4, init_std=0.08, dtype="bfloat16", **overrides)
    cfg, model = load_hf(ckpt)
    assert cfg.param_dtype == "bfloat16" and model.runtime.dtype == "bfloat16"
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    tokens, mask, positions = _batch(cfg.vocab_size, seed=5)
    ref32 = _torch_logits(ckpt, tokens, mask, positions, torch.float32)
    ref16 = _torch_logits(ckpt, tokens, mask, positions, torch.bfloat16)
    ours = np.asarray(_jax_logits(model, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(positions)))
    assert ours.dtype == np.float32
    err_ours = np.abs(ours - ref32)[mask].max()
    err_torch = np.abs(ref16 - ref32)[mask].max()
    scale = np.abs(ref32).max()
    assert err_ours <= 2 * err_torch + 0.02, (err_ours, err_torch)
    assert err_ours <= 0.05 * scale, (err_ours, scale)


def test_export_loads_in_transformers(tmp_path):
    """save_hf output is a checkpoint transformers reads, with the same logits."""
    ckpt = make_tiny_hf_checkpoint(tmp_path / "src", seed=6, init_std=0.08, **CONFIGS["mha_hd8"])
    cfg, model = load_hf(ckpt)
    save_hf(model, cfg, tmp_path / "out")
    tokens, mask, positions = _batch(cfg.vocab_size, seed=7)
    ref = _torch_logits(ckpt, tokens, mask, positions, torch.float32)
    again = _torch_logits(tmp_path / "out", tokens, mask, positions, torch.float32)
    np.testing.assert_array_equal(ref, again)
