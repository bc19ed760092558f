"""The `env` section (env.name=awm) -> one `AwmRuntime` (pool directory, database cache, server
pool) and a per-task-start `AwmEnv` factory.

Reads env.awm_dir (the pool, published layout), env.manifest (admitted ids, held-out split and
each task's verifier mode, written by `actionopd envs audit`), env.mcp_pool_size (0: the
collector's concurrency) and env.mcp_call_timeout_s. `judge` is the run's judge spec
(`teacher.specs.judge_spec(cfg.matcher)`), used by tasks verified in SQL + judge mode.

The factory exposes `runtime`, `tool_evidence(tasks)` (matcher evidence per scenario, read
from the warmed servers), `warm(tasks)`, `prefetch(tasks)` (start the servers of upcoming task
starts in the background, returning at once) and `close()`. Nothing starts until the first episode
or `warm`, so `--check` builds it for free.
"""

from __future__ import annotations

import atexit
from typing import Any, Mapping

from actionopd_jax.config import ConfigError
from actionopd_jax.envs.awm.env import AwmEnv
from actionopd_jax.envs.awm.layout import AwmDataset, load_awm
from actionopd_jax.envs.awm.runtime import AwmRuntime

DEFAULT_POOL_SIZE = 8


def load_pool(awm_dir: str) -> AwmDataset:
    if not awm_dir:
        raise ConfigError("env.name=awm needs env.awm_dir: a directory in AWM's published layout (docs/formats.md)")
    try:
        data = load_awm(awm_dir)
    except (FileNotFoundError, ValueError, KeyError) as err:
        raise ConfigError(f"env.awm_dir={awm_dir}: cannot load it as an AWM pool: {err}") from None
    if not data.scenarios:
        raise ConfigError(f"env.awm_dir={awm_dir}: no scenarios in gen_tasks.jsonl")
    return data


def manifest_entry(manifest: str, data: AwmDataset) -> dict[str, Any]:
    """The manifest's awm pool entry, checked against the loaded pool: every admitted (and
    held-out) id must be a task of env.awm_dir."""
    from actionopd_jax.envs.admission import read_manifest

    try:
        m = read_manifest(manifest)
    except (OSError, ValueError) as err:
        raise ConfigError(f"env.manifest={manifest}: not readable as an admission manifest ({err}); "
                          "write one with `actionopd envs audit --env awm --dir DIR --manifest FILE`") from None
    if "awm" not in m["admitted"]:
        raise ConfigError(f"env.manifest={manifest} has no awm pool; audit it first "
                          "(`actionopd envs audit --env awm --dir DIR --manifest FILE`)")
    have = {t.task_id for t in data.tasks()}
    for what in ("admitted", "heldout"):
        stray = sorted(m[what].get("awm", set()) - have)
        if stray:
            raise ConfigError(f"env.manifest={manifest} lists {len(stray)} {what} awm task(s) that are not tasks of "
                              f"env.awm_dir={data.root} (e.g. {stray[:3]}): the manifest was written for another "
                              "directory; audit this one")
    return {"admitted": m["admitted"]["awm"], "heldout": m["heldout"].get("awm", set()),
            "modes": dict(m["pools"]["awm"].get("verifier_modes") or {})}


def awm_env_factory(env: Any, *, concurrency: int | None = None, judge: Mapping[str, Any] | None = None,
                    cache_dir: str | None = None):
    data = load_pool(env.awm_dir)
    modes = manifest_entry(env.manifest, data)["modes"] if env.manifest else {}
    judge_fn = None
    if judge is not None and judge.get("base_url") and judge.get("model"):  # else SQL tasks score judge_error
        from actionopd_jax.envs.awm.judge import endpoint_judge

        try:
            judge_fn = endpoint_judge(judge)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    runtime = AwmRuntime(data, pool_size=env.mcp_pool_size or concurrency or DEFAULT_POOL_SIZE, modes=modes,
                         judge=judge_fn, cache_dir=cache_dir, call_timeout_s=env.mcp_call_timeout_s)
    atexit.register(runtime.close)

    def make(task) -> AwmEnv:
        if task.env != "awm":
            raise ValueError(f"the AWM environment factory got a {task.env!r} task ({task.task_id})")
        return AwmEnv(runtime)

    def scenarios(tasks) -> list[str]:
        return sorted({t.payload["scenario"] for t in tasks if t.env == "awm"})

    make.runtime = runtime
    make.tool_evidence = lambda tasks: runtime.evidence(scenarios(tasks))
    def warm(tasks) -> None:
        # servers of up to a pool's worth of scenarios not started yet (evidence may have done it)
        cold = [s for s in scenarios(tasks) if s not in runtime.tools]
        if cold:
            runtime.warm(cold[:runtime.pool_size])

    make.warm = warm
    # a step's drawn task starts, known before the step: their servers start in the background
    make.prefetch = lambda tasks: runtime.prefetch([t.payload["scenario"] for t in tasks if t.env == "awm"])

    def close() -> None:   # now, and no longer at exit (atexit would keep the runtime alive till then)
        atexit.unregister(runtime.close)
        runtime.close()

    make.close = close
    return make


EVAL_SPLITS = ("heldout", "admitted", "all")


def awm_eval_tasks(which: str, *, awm_dir: str = "", manifest: str = "") -> tuple[list, str]:
    """(tasks, the pool directory) for `eval --bench awm[:heldout|admitted|all]`: the manifest's
    held-out split (default; never trained on), its admitted tasks, or every task of the dir.
    The directory defaults to the one the manifest was audited from. Tasks carry split=`which`."""
    from dataclasses import replace

    which = which or "heldout"
    if which not in EVAL_SPLITS:
        raise ValueError(f"awm:{which}: choose awm:heldout, awm:admitted or awm:all")
    entry: dict[str, Any] = {}
    if manifest:
        from actionopd_jax.envs.admission import read_manifest

        entry = read_manifest(manifest)["pools"].get("awm") or {}
        awm_dir = awm_dir or entry.get("dir", "")
    elif which != "all":
        raise ValueError(f"awm:{which} reads the admission manifest: pass --manifest (written by `actionopd envs audit "
                         "--env awm --heldout-fraction F`), or use awm:all with --awm-dir")
    try:
        data = load_pool(awm_dir)
        picked = manifest_entry(manifest, data)[which] if which != "all" else None
    except ConfigError as err:
        raise ValueError(str(err)) from None
    if picked is not None and not picked:
        raise ValueError(f"the manifest {manifest} has no {which} awm tasks"
                         + (" (audit with --heldout-fraction F to keep some for evaluation)" if which == "heldout" else ""))
    tasks = [replace(t, split=which) for t in data.tasks() if picked is None or t.task_id in picked]
    return tasks, awm_dir
