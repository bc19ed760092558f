"""Benchmark selection for evaluation: `bfcl[:cat1,cat2]`, `tau2_<domain>[:split]` and
`awm[:heldout|admitted|all]` (an AWM pool's split from its admission manifest)."""

from __future__ import annotations

from actionopd_jax.types import Task


def select_tasks(spec: str, *, limit: int | None = None, awm_dir: str = "", manifest: str = "") -> list[Task]:
    """`bfcl` (all four categories), `bfcl:base,miss_param`, `tau2_airline` (test split),
    `tau2_retail:train`. `limit` keeps the first N tasks of each spec (in dataset order)."""
    name, _, option = spec.partition(":")
    if name == "bfcl":
        from actionopd_jax.envs.bfcl_data import CATEGORIES, bfcl_tasks

        cats = tuple(c for c in option.split(",") if c) or CATEGORIES
        unknown = [c for c in cats if c not in CATEGORIES]
        if unknown:
            raise ValueError(f"unknown BFCL categories {unknown}; choose from {list(CATEGORIES)}")
        tasks = [t for c in cats for t in bfcl_tasks((c,))[: limit or None]]
    elif name.startswith("tau2_"):
        from actionopd_jax.envs.tau2_tasks import tau2_tasks

        tasks = tau2_tasks(name[len("tau2_"):], option or "test")[: limit or None]
    elif name == "awm":
        from actionopd_jax.envs.awm.factory import awm_eval_tasks

        tasks = awm_eval_tasks(option, awm_dir=awm_dir, manifest=manifest)[0][: limit or None]
    else:
        raise ValueError(f"unknown benchmark {spec!r}; use bfcl[:categories], tau2_<airline|retail|telecom>[:split] "
                         "or awm[:heldout|admitted|all]")
    return tasks
