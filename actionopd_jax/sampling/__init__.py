"""On-device sampling: jitted prefill + `lax.while_loop` decode, per-row stops, traced
temperature / top-k / top-p, explicit PRNG keys, n samples sharing one prefill."""

from actionopd_jax.sampling.buckets import Buckets
from actionopd_jax.sampling.sampler import CompileStats, Generation, SampleResult, Sampler
from actionopd_jax.sampling.token_choice import choose_tokens

__all__ = ["Buckets", "CompileStats", "Generation", "SampleResult", "Sampler", "choose_tokens"]
