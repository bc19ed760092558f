"""Launcher side of the multi-process settings: Vertex AI's CLUSTER_SPEC as the ACTIONOPD_*
variables the trainer reads (actionopd_jax/train/distributed_env.py owns their names and
parsing).
"""

from __future__ import annotations

import json

from actionopd_jax.train.distributed_env import DistributedSettings


def settings_from_vertex_cluster_spec(cluster_spec: str, *,
                                      coordinator_port: int | None = None) -> DistributedSettings:
    """Derive the settings from the CLUSTER_SPEC JSON Vertex AI gives every replica.

    Pools are ordered workerpool0 (the primary, one replica), workerpool1, ...; process ids
    count replicas in that order, and the coordinator is workerpool0's first replica.
    """
    try:
        spec = json.loads(cluster_spec)
        cluster, task = spec["cluster"], spec["task"]
        pools = sorted(cluster, key=lambda name: int(name.removeprefix("workerpool")))
        offsets, total = {}, 0
        for name in pools:
            offsets[name] = total
            total += len(cluster[name])
        process_id = offsets[task["type"]] + int(task["index"])
        primary = cluster[pools[0]][0]
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise ValueError(f"CLUSTER_SPEC is not a Vertex AI cluster spec ({err!r})") from None
    if coordinator_port is not None:
        primary = f"{primary.rpartition(':')[0] or primary}:{coordinator_port}"
    return DistributedSettings(coordinator=primary, num_processes=total, process_id=process_id)
