"""Benchmark selection for evaluation: `bfcl[:cat1,cat2]`, `tau2_<domain>[:split]`,
`envscaler:DIR[:id1,id2]` (an EnvScaler directory in the published layout, optionally only the
named task ids: a run's held-out tasks) and `awm[:heldout|admitted|all]` (an AWM pool's split
from its admission manifest)."""

from __future__ import annotations

from actionopd_jax.types import Task


def spec_problem(spec: str) -> str:
    """What is wrong with a `--bench` spec's syntax ("" when nothing), without reading any
    data: the config checks run it on `eval.benchmarks` when a recipe is loaded."""
    name, _, option = spec.partition(":")
    if name == "bfcl":
        from actionopd_jax.envs.bfcl_data import CATEGORIES

        unknown = [c for c in option.split(",") if c and c not in CATEGORIES]
        return f"{spec!r}: unknown BFCL categories {unknown}; choose from {list(CATEGORIES)}" if unknown else ""
    if name.startswith("tau2_"):
        from actionopd_jax.envs.tau2_tasks import DOMAINS, SPLITS

        domain = name[len("tau2_"):]
        if domain not in DOMAINS:
            return f"{spec!r}: unknown tau2 domain {domain!r}; choose from {', '.join(DOMAINS)}"
        if option and option not in SPLITS:
            return f"{spec!r}: unknown tau2 split {option!r}; choose from {', '.join(SPLITS)}"
        return ""
    if name == "envscaler":
        return "" if option.partition(":")[0] else f"{spec!r}: envscaler:DIR[:ids] needs the EnvScaler directory"
    if name == "awm":
        return "" if option in ("", "heldout", "admitted", "all") else \
            f"{spec!r}: choose awm, awm:heldout, awm:admitted or awm:all"
    return (f"unknown benchmark {spec!r}; use bfcl[:categories], tau2_<airline|retail|telecom>[:split], "
            "envscaler:DIR[:ids] or awm[:heldout|admitted|all]")


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
    elif name == "envscaler":
        from actionopd_jax.envs.envscaler.layout import load_envscaler

        directory, _, ids = option.partition(":")
        if not directory:
            raise ValueError("--bench envscaler:DIR[:id1,id2] needs the EnvScaler directory")
        tasks = load_envscaler(directory).tasks(split="eval")
        wanted = [i for i in ids.split(",") if i]
        missing = sorted(set(wanted) - {t.task_id for t in tasks})
        if missing:
            raise ValueError(f"--bench {spec}: no EnvScaler task(s) {missing} in {directory}")
        tasks = [t for t in tasks if not wanted or t.task_id in wanted][: limit or None]
    elif name == "awm":
        from actionopd_jax.envs.awm.factory import awm_eval_tasks

        tasks = awm_eval_tasks(option, awm_dir=awm_dir, manifest=manifest)[0][: limit or None]
    else:
        raise ValueError(f"unknown benchmark {spec!r}; use bfcl[:categories], tau2_<airline|retail|telecom>[:split] "
                         ", envscaler:DIR[:ids] or awm[:heldout|admitted|all]")
    return tasks
