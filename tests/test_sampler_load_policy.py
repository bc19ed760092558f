"""`Sampler.load_policy`: the one way weights reach a sampler after it is built, checked leaf by
leaf (shape against the model config, dtype and sharding against the first weights)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from actionopd_jax.sampling import Buckets, Sampler
from tests._sampler_fixtures import random_model

BUCKETS = Buckets(prompt_len=(16,), prompts=(1, 2), samples=(1, 2), max_new=(8,))
VOCAB = 256


@pytest.fixture(scope="module")
def model():
    return random_model(3, vocab_size=VOCAB)


def _sample(sampler):
    prompts = [np.arange(1, 6, dtype=np.int32), np.arange(3, 12, dtype=np.int32)]
    result = sampler.sample(prompts, n=2, max_new_tokens=8, temperature=0.7, key=jax.random.key(1))
    return [[g.token_ids.tolist() for g in row] for row in result.generations]


def test_loaded_weights_sample_like_a_sampler_built_with_the_model(model):
    built = Sampler(model, eos_ids=[], buckets=BUCKETS)
    loaded = Sampler(None, model.cfg, eos_ids=[], buckets=BUCKETS)
    graphdef, params = nnx.split(model)
    loaded.load_policy(graphdef, nnx.to_pure_dict(params))
    assert _sample(loaded) == _sample(built)


def test_the_checked_head_cache_survives_a_reload_of_the_same_weights(model):
    sampler = Sampler(None, model.cfg, eos_ids=[], buckets=BUCKETS)
    graphdef, params = nnx.split(model)
    sampler.load_policy(graphdef, params)
    _sample(sampler)
    kept = sampler._checked
    sampler.load_policy(graphdef, params)   # the same head array: nothing to rebuild
    _sample(sampler)
    assert kept is not None and sampler._checked is kept
    sampler.load_policy(graphdef, jax.tree.map(lambda x: x + 0, nnx.to_pure_dict(params)))  # an update
    _sample(sampler)
    assert sampler._checked is not kept


def test_a_wrong_shape_names_the_leaf(model):
    sampler = Sampler(None, model.cfg, eos_ids=[], buckets=BUCKETS)
    graphdef, params = nnx.split(model)
    bad = nnx.to_pure_dict(params)
    bad["embed_tokens"] = jnp.zeros((VOCAB + 1, bad["embed_tokens"].shape[1]), bad["embed_tokens"].dtype)
    with pytest.raises(ValueError, match=r"\['embed_tokens'\] has shape"):
        sampler.load_policy(graphdef, bad)
    missing = nnx.to_pure_dict(params)
    del missing["norm"]
    with pytest.raises(ValueError, match="missing"):
        sampler.load_policy(graphdef, missing)


def test_dtype_and_sharding_are_those_of_the_first_weights(model):
    sampler = Sampler(None, model.cfg, eos_ids=[], buckets=BUCKETS)
    graphdef, params = nnx.split(model)
    pure = nnx.to_pure_dict(params)
    sampler.load_policy(graphdef, pure)
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), pure)
    with pytest.raises(ValueError, match="has dtype bfloat16"):
        sampler.load_policy(graphdef, cast)
    mesh = jax.make_mesh((1,), ("tensor",), devices=jax.devices()[1:2])
    moved = jax.device_put(pure, NamedSharding(mesh, PartitionSpec()))
    with pytest.raises(ValueError, match="is placed as"):
        sampler.load_policy(graphdef, moved)
    built = Sampler(model, eos_ids=[], buckets=BUCKETS)   # built with a model: its weights are the reference
    with pytest.raises(ValueError, match="has dtype bfloat16"):
        built.load_policy(graphdef, cast)
