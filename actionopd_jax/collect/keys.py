"""PRNG keys for collection, derived only from where a decision sits in the run.

Every random choice of a collection step -- the student's N samples at a state, the
commit tie-break, the random-commit ablation -- uses a key folded from
(seed, step, task start, decision index, purpose). None of these depends on the order in
which async events complete, on how ready states were batched into a device call, or on
how many processes share the task starts, so a cache-warm rerun, a resumed run and a run
on a different number of hosts produce the same groups.

`task_start` is the GLOBAL index of the task start within the step (not a per-process
index), which is what makes the multi-host split invisible to the keys.
"""

from __future__ import annotations

import jax
import numpy as np

# Purposes: distinct constants so the student's sampling key and the tie-break key of the
# same state are independent streams.
STUDENT_SAMPLES = 0
COMMIT = 1


def _check_index(name: str, value: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if value >= 2**32:
        raise ValueError(f"{name}={value} does not fit a 32-bit fold_in value")
    return int(value)


def state_key(seed: int, step: int, task_start: int, decision: int) -> jax.Array:
    """The root key of one decision point (state) of one task start in one step."""
    key = jax.random.key(_check_index("seed", seed))
    for name, value in (("step", step), ("task_start", task_start), ("decision", decision)):
        key = jax.random.fold_in(key, _check_index(name, value))
    return key


def purpose_key(key: jax.Array, purpose: int) -> jax.Array:
    return jax.random.fold_in(key, purpose)


def student_key(seed: int, step: int, task_start: int, decision: int) -> jax.Array:
    """Key handed to the sampler for this state's N candidates (one key per prompt)."""
    return purpose_key(state_key(seed, step, task_start, decision), STUDENT_SAMPLES)


def commit_key(seed: int, step: int, task_start: int, decision: int) -> jax.Array:
    """Key for the commit choice (uniform tie-break, or the random-commit ablation)."""
    return purpose_key(state_key(seed, step, task_start, decision), COMMIT)


def uniform_index(key: jax.Array, n: int) -> int:
    """A uniform draw from range(n) (n >= 1) under `key`, as a host int."""
    if n < 1:
        raise ValueError(f"cannot draw from an empty range (n={n})")
    return int(jax.random.randint(key, (), 0, n))
