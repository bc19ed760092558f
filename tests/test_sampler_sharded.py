"""The Sampler over parameters sharded on an 8-device CPU mesh gives the single-device output."""

import jax
import numpy as np
import pytest

from actionopd_jax.model import make_mesh, shard_model
from actionopd_jax.sampling import Buckets, Sampler
from tests._sampler_fixtures import random_model

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 host devices (tests/conftest.py)")

BUCKETS = Buckets(prompt_len=(32,), prompts=(4,), samples=(2,), max_new=(8,))


@pytest.mark.parametrize("backend", ["auto", "accelerator"])
@pytest.mark.parametrize("shape", [{"data": 2, "fsdp": 2, "tensor": 2}])
def test_sharded_params_give_the_same_samples(shape, backend):
    """backend "accelerator": the scan path with its sharding constraints on the stacked
    caches (KV heads over tensor, prompt rows over data/fsdp), forced on the CPU mesh."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (4, 19, 30)]
    kw = dict(n=2, max_new_tokens=8, key=jax.random.key(1))
    single = Sampler(random_model(5, vocab_size=256), eos_ids=[], buckets=BUCKETS)
    greedy_ref = single.sample(prompts, temperature=0.0, **kw)
    sampled_ref = single.sample(prompts, temperature=1.0, top_k=10, **kw)

    mesh = make_mesh(shape)
    model = shard_model(random_model(5, vocab_size=256), mesh)
    assert len(model.layers.mlp.gate_proj[...].sharding.device_set) == 8
    sharded = Sampler(model, eos_ids=[], buckets=BUCKETS, mesh=mesh, backend=backend)
    greedy = sharded.sample(prompts, temperature=0.0, **kw)
    sampled = sharded.sample(prompts, temperature=1.0, top_k=10, **kw)
    if backend == "accelerator":   # the stacked caches are sharded, not replicated
        (prefill,) = [p for k, p in sharded._programs.items() if k[0] == "prefill"]
        state = prefill.output_shardings
        assert not state.gen_k.is_fully_replicated and not state.prompt.k.is_fully_replicated
    for ref, got in ((greedy_ref, greedy), (sampled_ref, sampled)):
        for ref_gens, got_gens in zip(ref.generations, got.generations):
            for r, g in zip(ref_gens, got_gens):
                np.testing.assert_array_equal(r.token_ids, g.token_ids)
                np.testing.assert_allclose(r.logprobs, g.logprobs, atol=1e-4 if backend == "auto" else 1e-3)
