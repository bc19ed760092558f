"""The training task sets the `env` config section names, and the seeded stream a trainer's
source draws each step's task starts from (envs.tasks.TaskStream). One reading of env.* for
the collector, the baselines and `train --check`."""

from __future__ import annotations

import logging
from typing import Any

from actionopd_jax.config import ConfigError, EnvConfig
from actionopd_jax.envs.splits import check_eval_overlap, overlap_summary, select_task_ids
from actionopd_jax.envs.mixture import POOLS, missing_pool_files, mixture_entries, mixture_stream_from, mixture_summary
from actionopd_jax.envs.tasks import TaskSource, TaskStream, load_task_set

log = logging.getLogger(__name__)


def screening_check(env: EnvConfig, stream: Any) -> str:
    """Paper B.1 for the pools a run draws from: "" when every training task of each pool has a
    current feasibility-screen record (judged feasible on the source the pool holds today);
    else, with env.require_screening, a ConfigError naming `actionopd envs screen` (issue 43
    item 5: a paper recipe never trains on an unscreened pool), and without it the warning text
    (the run logs it every time, `--check` prints it)."""
    from actionopd_jax.envs.admission import read_manifest
    from actionopd_jax.envs.screen_manifest import pool_source_hashes, screening_message, unscreened

    pools = read_manifest(env.manifest)["pools"]
    problems = []
    for name, tasks, _ in stream.pools:
        directory = env.awm_dir if name == "awm" else env.envscaler_dir
        hashes = pool_source_hashes(name, directory, list(tasks), pools.get(name))
        gaps = unscreened(pools.get(name), hashes)
        if gaps:
            problems.append(screening_message(name, gaps, len(tasks), env.manifest))
    if not problems:
        return ""
    if env.require_screening:
        raise ConfigError("env.require_screening: " + "; ".join(problems)
                          + ". To train on it unscreened, set env.require_screening: false (a warning every run)")
    how = ("env.require_screening is false" if env.require_screening is False
           else "env.require_screening is not set")
    return (f"warning: training on tasks the paper's B.1 feasibility screen has not kept ({how}): "
            + "; ".join(problems))


def _pool_stream(env: EnvConfig, *, per_step: int, seed: int, announce: bool) -> tuple[Any, str]:
    """The pools' mixture stream and the screening warning ("" when none); `announce`: log it."""
    stream = mixture_stream_from(env, per_step=per_step, seed=seed)
    warning = screening_check(env, stream)
    if warning and announce:
        log.warning("%s", warning)
    return stream, warning


def task_set_names(env: EnvConfig, *, needed_by: str) -> list[tuple[str, str]]:
    """The (environment, split) task sets `env` names: BFCL categories or tau2 domains.
    `needed_by` names the caller in the error for an unsupported env.name."""
    if env.name == "bfcl":
        return [("bfcl", d) for d in (env.domains or ("all",))]
    if env.name == "tau2":
        if not env.domains:
            raise ConfigError("env.name=tau2 needs env.domains (airline, retail, telecom)")
        return [(f"tau2_{d}", env.split) for d in env.domains]
    if env.name == "mcp":
        if not env.tasks_file:
            raise ConfigError("env.name=mcp needs env.tasks_file (JSON lines of tasks, envs/mcp/tasks.py)")
        return [("mcp", env.split)]
    raise ConfigError(f"{needed_by} needs env.name bfcl, tau2 or mcp, got {env.name!r}")


def training_task_sets(env: EnvConfig, *, needed_by: str) -> list[tuple[str, list]]:
    """(name, tasks) of every task set `env` names, narrowed to env.task_ids when given; training
    on tasks evaluation scores is refused unless env.allow_eval_overlap (envs/splits.py). The
    AWM / EnvScaler pools: each pool's admitted training tasks (the manifest's, without its
    held-out split), what their mixture draws from."""
    if env.name in POOLS:
        stream, _ = _pool_stream(env, per_step=sum(c for _, c in mixture_entries(env)), seed=0, announce=False)
        return [(f"{name}:admitted", list(tasks)) for name, tasks, _ in stream.pools]
    sets = [(f"{name}:{split}", _task_set(env, name, split)) for name, split in task_set_names(env, needed_by=needed_by)]
    every = select_task_ids([t for _, tasks in sets for t in tasks], env.task_ids)
    keep = {(t.env, t.task_id) for t in every}
    sets = [(name, [t for t in tasks if (t.env, t.task_id) in keep]) for name, tasks in sets]
    sets = [(name, tasks) for name, tasks in sets if tasks]
    check_eval_overlap(env, every)
    return sets


def _task_set(env: EnvConfig, name: str, split: str) -> list:
    if name == "mcp":
        from actionopd_jax.envs.mcp.tasks import load_mcp_tasks

        return load_mcp_tasks(env.tasks_file, split)
    return load_task_set(name, split)


def task_stream_from(env: EnvConfig, *, per_step: int, seed: int, needed_by: str = "collect.kind=actionopd") -> TaskStream:
    """`per_step` task starts a step (collect.task_starts_per_step) shared over the task sets.
    Every process builds the same stream (same seed): the same global list per step. The AWM /
    EnvScaler pools (env.name awm / envscaler) give the with-replacement mixture instead
    (envs/mixture.py), drawn from the manifest's admitted tasks."""
    if env.name in POOLS:
        return _pool_stream(env, per_step=per_step, seed=seed, announce=True)[0]
    sets = training_task_sets(env, needed_by=needed_by)
    if per_step < len(sets):
        raise ConfigError(f"collect.task_starts_per_step={per_step} is smaller than the {len(sets)} task sources")
    quotas = [per_step // len(sets) + (i < per_step % len(sets)) for i in range(len(sets))]
    sources = [(TaskSource(name, tasks), q) for (name, tasks), q in zip(sets, quotas)]
    return TaskStream(sources, seed=int(seed))


def training_tasks_summary(env: EnvConfig, *, needed_by: str) -> str:
    """One line on the training tasks `env` names and their overlap with what evaluation scores
    (envs/splits.overlap_summary); raises ConfigError when the run would refuse them. For the
    AWM / EnvScaler pools: their admitted sizes from the manifest (they are never evaluated on),
    and a second line on EnvScaler's conversational scenarios and their user simulator."""
    if env.name in POOLS:
        missing = missing_pool_files(env)
        if missing:
            return (f"pools      not on this host ({', '.join(missing)}): the run loads them at start; "
                    "write the manifest with `actionopd envs audit`")
        per_step = sum(c for _, c in mixture_entries(env))
        stream, warning = _pool_stream(env, per_step=per_step, seed=0, announce=False)
        lines = [mixture_summary(stream)] + ([warning] if warning else [])
        for name, tasks, _ in stream.pools:
            if name == "envscaler":  # which scenarios the user simulator plays, and with which model
                from actionopd_jax.envs.envscaler.factory import conversational_summary

                lines.append(conversational_summary(env, tasks))
        return "\n".join(lines)
    tasks = [t for _, ts in training_task_sets(env, needed_by=needed_by) for t in ts]
    return f"tasks      {overlap_summary(env, tasks)}"


def stream_tasks(stream: Any) -> list | None:
    """Every task a stream can start, when it says (envs.tasks.TaskStream, or a wrapper of one
    with `.stream`); None for other streams (test doubles)."""
    for s in (stream, getattr(stream, "stream", None)):
        tasks = getattr(s, "tasks", None)
        if isinstance(tasks, list):
            return tasks
    return None
