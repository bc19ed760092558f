"""New weights for a running engine (issue 44: asynchronous collection swaps them in between
segments, without draining the rows in flight).

`load_policy` may run while requests are in the engine, between two `step` calls (the stepping
thread's own call, as collect/engine_worker.EngineWorker.swap makes it):
- running rows keep their slots and KV pages -- keys and values computed under the old weights,
  as the in-flight updates of PipelineRL and AReaL keep them -- and sample their next tokens with
  the new weights from the next segment on; every generated token records the version of the
  weights that sampled it (`Request.versions`), and a request the version it was admitted under
  (`Request.version`, the oldest its samples depend on: its prompt's keys and values);
- the prefix index is dropped at the next step, so a request admitted after the swap never reads
  an old page; a request admitted before it never enters its pages into the index afterwards
  (`indexable`): its pages hold old keys and values. Pages the running rows hold stay theirs
  (PagePool.clear_index frees only the pages nobody holds);
- the pool is sized once (a swap keeps it); shapes, dtypes and the cache dtype are checked as at
  the first load; the mesh cannot change under running rows (their pages live on it).
Weights changed any other way while rows run (the model's arrays replaced behind the engine's
back) are still an error (Engine._check_weights).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx


def load_policy(engine: Any, graphdef: Any, params: Any, mesh: Any = None, version: int | None = None) -> None:
    """Engine.load_policy (module docstring). version: the stamp of what the new weights sample
    (a trainer step); None: the previous one + 1."""
    from actionopd_jax.sampling.policy_specs import check_policy, leaf_specs, policy_record

    if engine.busy and mesh is not engine.mesh and mesh != engine.mesh:
        raise RuntimeError("load_policy with another mesh while requests are in the engine: their KV pages live on "
                           "the engine's mesh; change the mesh only when the engine is idle")
    got = leaf_specs(params)
    engine._policy = policy_record(engine._policy, engine.model, engine.cfg, got)
    check_policy(engine._policy, got)
    model = nnx.merge(graphdef, params)
    if jnp.dtype(model.runtime.dtype) != engine.dtype:
        raise ValueError(f"load_policy: the model computes in {model.runtime.dtype}, the engine's cache was "
                         f"built for {engine.dtype}; build the engine with dtype={model.runtime.dtype!r}")
    engine.model, engine.mesh = model, mesh
    engine.version = engine.version + 1 if version is None else int(version)
    engine._loaded = True     # the next step's weight check takes the change (and drops the prefix cache)
    if engine.pages is None:
        engine._size_pool()


def indexable(engine: Any, req: Any) -> bool:
    """Whether `req`'s pages may enter the prefix index: only while the cache it was admitted
    under is still the engine's (no invalidation since), else they hold other weights' keys and
    values."""
    return req.cache_epoch == engine.pages.stats.invalidations


__all__ = ["indexable", "load_policy"]
