"""Which rollout path samples the student: `collect.sampler` and `eval --sampler`.

"engine" (continuous batching over a paged cache, engine/) or "static" (batched device
calls, sampling/: the oracle the engine's tests are held to). "auto", the default, is the
engine except where a device measured it slower than the static sampler:

- NVIDIA GPUs: static. On one H200 (jax 0.11.2, 2026-12-04, docs/measurements.md), Qwen3-4B,
  64 rows of 16 prompts of 1,024-4,096 tokens, 256 new: the engine decoded 1,844 tok/s against
  static's 3,242 (0.57x) and ran 663 tok/s end to end against 2,766 (0.24x; its prefill, one
  query per kernel row, 15.8 s against 0.86 s); at 256 rows the engine ran out of memory.
- CPU: the engine (same tokens; the main job's ActionOPD phase 534 s against 667 s).
- TPU: the engine (compiler estimates only; nothing has run on a TPU yet).
"""

from __future__ import annotations

SAMPLER_KINDS = ("auto", "engine", "static")
# the platforms whose "auto" is the static sampler, each with the measurement that put it there
STATIC_ON = ("gpu", "cuda", "rocm")


def rollout_sampler(setting: str, platform: str) -> str:
    """"engine" or "static" for `setting` on `platform` (jax's name: "cpu", "gpu", "tpu", or a
    lowering target's: "cuda", "rocm")."""
    if setting not in SAMPLER_KINDS:
        raise ValueError(f"sampler={setting!r}; expected one of {SAMPLER_KINDS}")
    if setting != "auto":
        return setting
    return "static" if platform in STATIC_ON else "engine"


__all__ = ["SAMPLER_KINDS", "STATIC_ON", "rollout_sampler"]
