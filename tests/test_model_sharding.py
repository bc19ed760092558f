"""Sharded forward on 8 CPU devices equals the single-device forward; rules table behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from actionopd_jax.model import (KVCache, LOGICAL_AXIS_RULES, left_pad_positions, make_mesh,
                                 param_shardings, shard_model)
from actionopd_jax.model.sharding import logical_to_spec
from actionopd_jax.model.weights import load_hf
from actionopd_jax.testing.tiny_checkpoint import make_tiny_numpy_checkpoint

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 host devices (tests/conftest.py)")

OVERRIDES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_hidden_layers=2, tie_word_embeddings=False)


@nnx.jit
def _logits(model, tokens, positions, mask):
    h, _ = model(tokens, positions, attention_mask=mask)
    return model.logits(h)


@nnx.jit
def _decode(model, tokens, positions, mask, cache):
    h, cache = model(tokens, positions, attention_mask=mask, cache=cache)
    return model.logits(h[:, -1]), cache


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_numpy_checkpoint(tmp_path_factory.mktemp("shard") / "m", seed=11, init_std=0.08,
                                      **OVERRIDES)


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (8, 10)).astype(np.int32)
    mask = np.ones((8, 10), bool)
    mask[1::2, :4] = False
    return tokens, mask, np.asarray(left_pad_positions(jnp.asarray(mask)))


@pytest.mark.parametrize("shape", [{"fsdp": 8}, {"data": 2, "fsdp": 2, "tensor": 2}, {"data": 2, "tensor": 4}])
def test_sharded_forward_equals_single_device(ckpt, shape):
    tokens, mask, positions = _batch()
    _, single = load_hf(ckpt)
    ref = np.asarray(_logits(single, tokens, positions, mask))

    mesh = make_mesh(shape)
    _, sharded = load_hf(ckpt, mesh=mesh)
    q = sharded.layers.self_attn.q_proj[...]
    assert q.sharding.spec == logical_to_spec(("layers", "embed", "heads", "head_dim"), mesh, shape=q.shape)
    assert len({d for d in q.sharding.device_set}) == 8
    with jax.set_mesh(mesh):
        got = np.asarray(_logits(sharded, tokens, positions, mask))
        cache = KVCache.init(sharded.cfg, 8, 12)
        dec, cache = _decode(sharded, tokens, positions, mask, cache)
    np.testing.assert_allclose(got[mask], ref[mask], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dec), ref[:, -1], atol=2e-5, rtol=1e-5)


def test_shard_model_places_params_per_rules(ckpt):
    _, model = load_hf(ckpt)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shard_model(model, mesh)
    assert model.embed_tokens[...].sharding.spec == P("tensor", "fsdp")
    assert model.layers.mlp.down_proj[...].sharding.spec == P(None, "tensor", "fsdp")
    assert model.layers.self_attn.o_proj[...].sharding.spec == P(None, "tensor", None, "fsdp")
    shardings = param_shardings(model, mesh)
    assert shardings["layers"]["mlp"]["gate_proj"].get_value().spec == P(None, "fsdp", "tensor")
    tokens, mask, positions = _batch()
    _, single = load_hf(ckpt)
    with jax.set_mesh(mesh):
        got = np.asarray(_logits(model, tokens, positions, mask))
    np.testing.assert_allclose(got[mask], np.asarray(_logits(single, tokens, positions, mask))[mask],
                               atol=2e-5, rtol=1e-5)


def test_indivisible_dims_fall_back_to_replication():
    mesh = make_mesh({"data": 2, "tensor": 4})
    # one KV head cannot be split over tensor=4; embed has no rule to "data"
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), mesh, shape=(64, 1, 16)) == P(None, None, None)
    assert logical_to_spec(("batch", "length"), mesh, shape=(6, 3)) == P("data", None)
    assert logical_to_spec(("batch", "length"), mesh, shape=(3, 3)) == P(None, None)
    with pytest.raises(KeyError, match="no entry"):
        logical_to_spec(("bogus",), mesh)


def test_rules_table_is_data_and_mesh_errors_are_clear():
    assert all(isinstance(k, str) for k, _ in LOGICAL_AXIS_RULES)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        make_mesh({"model": 8})
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh({"fsdp": 16})
    assert dict(zip(make_mesh({"data": 2, "fsdp": -1}).axis_names, make_mesh({"data": 2, "fsdp": -1}).axis_sizes)) \
        == {"data": 2, "fsdp": 4}


def test_init_model_on_mesh_and_sharded_cache():
    from actionopd_jax.model import cache_shardings, init_model
    from actionopd_jax.testing.tiny_checkpoint import tiny_config

    cfg = tiny_config(**OVERRIDES)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    key = jax.random.key(3)
    sharded = init_model(cfg, key, mesh=mesh)
    plain = init_model(cfg, key)
    assert sharded.layers.mlp.gate_proj[...].sharding.spec == P(None, "fsdp", "tensor")
    np.testing.assert_array_equal(np.asarray(sharded.layers.mlp.gate_proj[...]),
                                  np.asarray(plain.layers.mlp.gate_proj[...]))
    cache = KVCache.init(cfg, 8, 12)
    cache = jax.device_put(cache, cache_shardings(cache, mesh))
    assert cache.k.sharding.spec == P(None, ("data", "fsdp"), None, "tensor", None)
    tokens, mask, positions = _batch()
    with jax.set_mesh(mesh):
        dec, cache = _decode(sharded, tokens, positions, mask, cache)
    ref, _ = _decode(plain, tokens, positions, mask, KVCache.init(cfg, 8, 12))
    np.testing.assert_allclose(np.asarray(dec), np.asarray(ref), atol=2e-5, rtol=1e-5)
