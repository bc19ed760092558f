"""Shared pieces of the engine tests: one tiny random model, the static sampler as reference,
and engine shapes the test files share (engines of equal shapes share compiled programs)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from _sampler_fixtures import random_model
from actionopd_jax.engine import Engine, EngineConfig
from actionopd_jax.sampling import Sampler

EOS = [3, 7, 11, 19, 42]          # several end tokens, so rows of a random model finish early
REF_PROMPTS = 8                   # reference calls are padded to 8 prompts: one static program pair
SHAPES = dict(slots=6, page_size=4, max_len=64, chunk=8, prefill_lanes=2, pages=48)


@functools.cache
def model():
    return random_model(0)


@functools.cache
def static_sampler():
    return Sampler(model(), eos_ids=EOS, lm_head="float32")


def engine(segment: int = 3, **overrides) -> Engine:
    return Engine(model(), eos_ids=EOS, lm_head="float32",
                  config=EngineConfig(segment=segment, **{**SHAPES, **overrides}))


def reference(prompts, keys, **settings):
    """The static sampler's generations for `prompts` (each with its own key); settings are
    per-prompt lists. The call is padded to REF_PROMPTS prompts (keys given per prompt, so
    padding changes nothing) to keep it to one compiled shape."""
    pad = REF_PROMPTS - len(prompts)
    assert pad >= 0
    prompts = list(prompts) + [np.ones(3, np.int32)] * pad
    keys = list(keys) + [jax.random.key(999)] * pad
    settings = {k: list(v) + [v[0]] * pad for k, v in settings.items()}
    return static_sampler().sample(prompts, key=keys, **settings).generations[:REF_PROMPTS - pad]


def assert_same(got, want, atol=1e-5):
    """Token-for-token equal generations; logprobs within atol (float32 rounding of a different
    summation order: prefill by chunk over pages instead of one padded forward)."""
    assert len(got) == len(want)
    for i, (g_state, w_state) in enumerate(zip(got, want)):
        assert len(g_state) == len(w_state), i
        for j, (g, w) in enumerate(zip(g_state, w_state)):
            assert g.token_ids.tolist() == w.token_ids.tolist(), (i, j, g.token_ids, w.token_ids)
            assert g.finish_reason == w.finish_reason, (i, j)
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=atol, rtol=0)
