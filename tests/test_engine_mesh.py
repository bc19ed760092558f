"""The engine on a tensor-parallel CPU mesh: its pool split by KV head over 2 devices, page
writes and copy-on-write copies run per device (paged.write_rows / copy_pages under shard_map),
and the samples are the single-device engine's."""

import jax
import numpy as np
from jax.sharding import Mesh

from _engine_fixtures import SHAPES, assert_same, engine, model
from actionopd_jax.engine import Engine, EngineConfig


def test_a_tensor_split_pool_gives_the_same_samples():
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    assert model().cfg.num_key_value_heads % 2 == 0
    split = Engine(model(), eos_ids=[3, 7, 11, 19, 42], lm_head="float32", mesh=mesh,
                   config=EngineConfig(segment=3, **SHAPES))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, size=int(n)).astype(np.int32) for n in (5, 9, 14)]   # partial last pages
    keys = [jax.random.key(40 + i) for i in range(3)]
    settings = dict(n=3, max_new_tokens=6, temperature=1.0)
    got = split.sample(prompts, key=keys, **settings).generations
    assert split.pool.k.sharding.spec[0] == "tensor"
    assert {s.data.shape[0] for s in split.pool.k.addressable_shards} == {model().cfg.num_key_value_heads // 2}
    assert_same(got, engine(3).sample(prompts, key=keys, **settings).generations)
