"""Advantages for the update, batch-wide across every process (paper eq. 7, A.4).

The rules live in `actionopd_jax.rewards`: centre each retained group by its mean, divide by
the population std of all centred rewards of the batch (+1e-8). With several processes the
"batch" is every process's groups together, so sigma is computed from all-gathered sums;
with one process this calls `rewards.batch_advantages` directly.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from actionopd_jax.rewards import batch_advantages
from actionopd_jax.train import distributed
from actionopd_jax.types import StateGroup

EPS = 1e-8


def assign_advantages(groups: Sequence[StateGroup], *, loss: str = "actionopd", eps: float = EPS) -> dict:
    """Set `group.advantages` on every retained group (None on the others); returns stats.

    KD and OPD do not use candidate advantages (KD imitates, OPD has token-level signals):
    their retained groups get ones so every row trains.
    """
    if loss != "actionopd":
        for g in groups:
            g.advantages = np.ones(len(g.candidates), np.float32) if g.retained else None
        return {"sigma": 0.0, "groups_retained": float(sum(g.retained for g in groups))}

    rewards_list = [g.rewards if g.retained else None for g in groups]
    retained = [bool(g.retained) for g in groups]
    if jax.process_count() == 1:
        result = batch_advantages(rewards_list, retained, eps=eps)
        advs, sigma = result.advantages, result.sigma
    else:
        centred = [None if r is None else np.asarray(r, np.float64) - np.mean(r) for r in rewards_list]
        local = np.array([sum(float(np.sum(c * c)) for c in centred if c is not None),
                          float(sum(c.size for c in centred if c is not None))])
        total = distributed.allgather(local).sum(axis=0)
        # centred rewards have mean 0 in every group, so the population std is sqrt(E[c^2])
        sigma = float(np.sqrt(total[0] / total[1])) if total[1] > 0 else 0.0
        advs = [None if c is None else c / (sigma + eps) for c in centred]
    for g, a in zip(groups, advs):
        g.advantages = None if a is None else np.asarray(a, np.float32)
    kept = [g for g in groups if g.retained]
    all_r = np.concatenate([g.rewards for g in kept]) if kept else np.zeros(0)
    # batch-wide counts (every process's groups)
    counts = distributed.allgather(np.array([len(groups), len(kept), all_r.sum(), all_r.size],
                                            np.float64)).sum(axis=0)
    return {
        "sigma": float(sigma),
        "groups": float(counts[0]),
        "groups_retained": float(counts[1]),
        "reward_mean": float(counts[2] / counts[3]) if counts[3] else 0.0,
    }
