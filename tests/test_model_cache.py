"""KV-cache decoding equals the full forward (left-padded batch, prefill + token-by-token)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from actionopd_jax.model import KVCache, Qwen3, left_pad_positions
from actionopd_jax.model.layers import rope_cos_sin
from actionopd_jax.model.runtime import RuntimeOptions
from actionopd_jax.testing.tiny_checkpoint import tiny_config

CFG = tiny_config(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def _model(key_seed, cfg=CFG, runtime=None):
    return Qwen3(cfg, runtime=runtime, rngs=nnx.Rngs(params=jax.random.key(key_seed)))


@nnx.jit
def _full(model, tokens, positions, mask):
    h, _ = model(tokens, positions, attention_mask=mask)
    return model.logits(h)


@nnx.jit
def _step(model, tokens, positions, mask, cache):
    h, cache = model(tokens, positions, attention_mask=mask, cache=cache)
    return model.logits(h), cache


def _left_padded(seed, lengths, total):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (len(lengths), total)).astype(np.int32)
    mask = np.zeros((len(lengths), total), bool)
    for i, n in enumerate(lengths):
        mask[i, total - n:] = True
    return tokens, mask


def test_prefill_then_decode_matches_full_forward():
    model = _model(0)
    prompt_len, new = 7, 5
    tokens, prompt_mask = _left_padded(1, [7, 4, 2], prompt_len)
    continuation = np.random.default_rng(2).integers(0, CFG.vocab_size, (3, new)).astype(np.int32)
    all_tokens = np.concatenate([tokens, continuation], 1)
    all_mask = np.concatenate([prompt_mask, np.ones((3, new), bool)], 1)
    all_pos = np.asarray(left_pad_positions(jnp.asarray(all_mask)))
    full = np.asarray(_full(model, all_tokens, all_pos, all_mask))

    cache = KVCache.init(CFG, batch=3, max_len=16)  # more slots than needed: extra slots stay invalid
    logits, cache = _step(model, tokens, all_pos[:, :prompt_len], prompt_mask, cache)
    assert int(cache.index) == prompt_len
    np.testing.assert_array_equal(np.asarray(cache.valid[:, :prompt_len]), prompt_mask)
    got = [np.asarray(logits)]
    for t in range(prompt_len, prompt_len + new):
        logits, cache = _step(model, all_tokens[:, t:t + 1], all_pos[:, t:t + 1], np.ones((3, 1), bool), cache)
        got.append(np.asarray(logits))
    got = np.concatenate(got, 1)
    assert int(cache.index) == prompt_len + new
    assert not np.asarray(cache.valid[:, prompt_len + new:]).any()
    np.testing.assert_allclose(got[all_mask], full[all_mask], atol=2e-5, rtol=1e-5)


def test_chunked_prefill_matches_single_prefill():
    """Two prefill chunks (the second attends to the first through the cache) = one call."""
    model = _model(3)
    tokens, mask = _left_padded(4, [9, 5], 9)
    pos = np.asarray(left_pad_positions(jnp.asarray(mask)))
    one, _ = _step(model, tokens, pos, mask, KVCache.init(CFG, 2, 12))
    first, cache = _step(model, tokens[:, :4], pos[:, :4], mask[:, :4], KVCache.init(CFG, 2, 12))
    second, cache = _step(model, tokens[:, 4:], pos[:, 4:], mask[:, 4:], cache)
    two = np.concatenate([np.asarray(first), np.asarray(second)], 1)
    np.testing.assert_allclose(two[mask], np.asarray(one)[mask], atol=2e-5, rtol=1e-5)


def test_stale_cache_contents_are_ignored():
    """Slots never written (garbage in k/v, valid=False) do not affect the result."""
    model = _model(5)
    tokens, mask = _left_padded(6, [6, 3], 6)
    pos = np.asarray(left_pad_positions(jnp.asarray(mask)))
    clean = KVCache.init(CFG, 2, 10)
    dirty = clean.replace(k=clean.k + 7.0, v=clean.v - 3.0)
    a, _ = _step(model, tokens, pos, mask, clean)
    b, _ = _step(model, tokens, pos, mask, dirty)
    np.testing.assert_allclose(np.asarray(a)[mask], np.asarray(b)[mask], atol=1e-6)


def test_bf16_cache_decoding_close_to_full():
    cfg = CFG.replace(param_dtype="bfloat16")
    model = _model(7, cfg, RuntimeOptions(dtype="bfloat16"))
    tokens, mask = _left_padded(8, [5, 3], 6)
    pos = np.asarray(left_pad_positions(jnp.asarray(mask)))
    full = np.asarray(_full(model, tokens, pos, mask))
    cache = KVCache.init(cfg, 2, 8, model.runtime.dtype)
    assert cache.k.dtype == jnp.bfloat16
    pre, cache = _step(model, tokens[:, :5], pos[:, :5], mask[:, :5], cache)
    last, cache = _step(model, tokens[:, 5:], pos[:, 5:], mask[:, 5:], cache)
    got = np.concatenate([np.asarray(pre), np.asarray(last)], 1)
    # stated tolerance: 2% of the logit range (bf16 rounding differs between the two paths)
    scale = np.abs(full[mask]).max()
    assert scale > 0.3
    assert np.abs(got - full)[mask].max() < 0.02 * scale


def test_cache_shape_mismatch_is_reported():
    model = _model(9)
    with pytest.raises(ValueError, match="cache holds"):
        model(jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32), cache=KVCache.init(CFG, 3, 4))


def test_decode_weights_give_the_layers_own_projections():
    """The decode step's fused, output-major weights (layers.dense_output_major) compute what
    the layer's own projections compute: q/k/v, the output projection and the MLP."""
    model = _model(5)
    graph, stacked = nnx.split(model.layers)
    layer = nnx.merge(graph, jax.tree.map(lambda x: x[1], stacked))  # layer 1 of the stack
    x = jax.random.normal(jax.random.key(0), (3, 2, CFG.hidden_size))
    cos, sin = rope_cos_sin(jnp.arange(2)[None], CFG.head_dim, CFG.rope_theta)
    attn, mlp = layer.self_attn, layer.mlp
    for a, b in zip(attn.project_qkv(x, cos, sin), attn.project_qkv(x, cos, sin, attn.fused_qkv_weight())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    groups = CFG.num_attention_heads // CFG.num_key_value_heads
    heads = jax.random.normal(jax.random.key(1), (3, 2, CFG.num_key_value_heads, groups, CFG.head_dim))
    np.testing.assert_allclose(attn.output(heads), attn.output(heads, attn.output_major_o_weight()),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mlp(x), mlp(x, mlp.fused_gate_up_weight(), mlp.output_major_down_weight()),
                               rtol=1e-5, atol=1e-6)
    # output-major: the contracted axis last
    assert mlp.fused_gate_up_weight().shape == (2 * CFG.intermediate_size, CFG.hidden_size)
    assert mlp.output_major_down_weight().shape == (CFG.hidden_size, CFG.intermediate_size)
    assert attn.output_major_o_weight().shape == (CFG.hidden_size, CFG.num_attention_heads, CFG.head_dim)
