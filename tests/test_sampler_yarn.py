"""YaRN RoPE reaches every place that builds rotary tables: the sampler's CPU backend and its
accelerator path (forced on CPU) give the argmax chain of full model forwards, with prompts
and continuations past the original context."""

import jax
import numpy as np
import pytest

from actionopd_jax.model.rope import RopeYarn
from actionopd_jax.sampling import Buckets, Sampler
from tests._sampler_fixtures import next_token_logits, random_model

BUCKETS = Buckets(prompt_len=(64,), prompts=(2,), samples=(1,), max_new=(16,))
# original context 16: the prompts (30, 45 tokens) and continuations run past it
YARN = RopeYarn(factor=8.0, original_max_position_embeddings=16, attention_factor=1.2, beta_fast=8.0)


@pytest.mark.parametrize("backend", ["cpu", "accelerator"])
def test_greedy_with_yarn_equals_full_forwards(backend):
    model = random_model(5, vocab_size=256, rope_yarn=YARN, rope_theta=1e4)
    plain = random_model(5, vocab_size=256, rope_theta=1e4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (30, 45)]
    out = Sampler(model, eos_ids=[], buckets=BUCKETS, backend=backend, lm_head="float32").sample(
        prompts, n=1, max_new_tokens=12, temperature=0.0, key=jax.random.key(0))
    for prompt, (gen,) in zip(prompts, out.generations):
        logits = next_token_logits(model, prompt, gen.token_ids)
        np.testing.assert_array_equal(gen.token_ids, logits.argmax(-1))
        # the scaling matters here: the same weights with plain RoPE predict differently
        assert np.abs(next_token_logits(plain, prompt, gen.token_ids) - logits).max() > 1e-3
