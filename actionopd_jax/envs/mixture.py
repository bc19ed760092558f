"""The task mixture of the AWM / EnvScaler training runs: `env.mixture` names pools and per-step
counts (the paper: "awm:59", "envscaler:5" of 64 task starts), and each step draws that many
tasks from each pool's admitted tasks uniformly WITH replacement.

Draws are counter-based: step s of pool i uses a generator seeded by (run seed, i, s), so the
stream is random access and its whole state is the next task-start index (plus a fingerprint of
the pools, counts and seed). `get_state` / `set_state` (the trainer's names for a task stream,
as envs.tasks.TaskStream) and `state_dict` / `load_state_dict` are the same JSON state.

When collect.task_starts_per_step differs from the mixture's sum (a smoke run asks for 1), the
counts are scaled to it by largest remainder, keeping the proportions; equal sums use the
counts as given.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import numpy as np

from actionopd_jax.types import Task

POOLS = ("awm", "envscaler")


def parse_mixture(entries: Sequence[str]) -> list[tuple[str, int]]:
    """("awm:59", "envscaler:5") -> [("awm", 59), ("envscaler", 5)]; ValueError on a bad entry."""
    out: list[tuple[str, int]] = []
    for e in entries:
        name, sep, count = str(e).partition(":")
        name = name.strip()
        if not sep or name not in POOLS:
            raise ValueError(f"env.mixture entry {e!r}: expected <pool>:<count> with pool one of {POOLS}")
        try:
            n = int(count)
        except ValueError:
            raise ValueError(f"env.mixture entry {e!r}: the count must be an integer") from None
        if n < 1:
            raise ValueError(f"env.mixture entry {e!r}: the count must be >= 1")
        if name in (p for p, _ in out):
            raise ValueError(f"env.mixture names pool {name!r} twice")
        out.append((name, n))
    return out


def scale_counts(counts: Sequence[int], total: int) -> list[int]:
    """Counts scaled to sum to `total` (largest remainder; ties to the earlier pool)."""
    s = sum(counts)
    if total == s:
        return list(counts)
    exact = [c * total / s for c in counts]
    base = [int(x) for x in exact]
    order = sorted(range(len(counts)), key=lambda i: (-(exact[i] - base[i]), i))
    for i in order[: total - sum(base)]:
        base[i] += 1
    return base


def _task_json(t: Task) -> list:
    return [t.task_id, t.env, t.split]


class MixtureStream:
    """`pools`: [(name, admitted tasks, per-step count)]. A pool with count 0 is never drawn."""

    def __init__(self, pools: Sequence[tuple[str, Sequence[Task], int]], *, seed: int):
        if not pools:
            raise ValueError("a mixture needs at least one pool")
        for name, tasks, count in pools:
            if count < 0:
                raise ValueError(f"pool {name!r}: negative count {count}")
            if count and not tasks:
                raise ValueError(f"pool {name!r} has no admitted tasks but is drawn {count} a step")
        self.pools = [(name, list(tasks), int(count)) for name, tasks, count in pools]
        self.step_size = sum(c for _, _, c in self.pools)
        if self.step_size < 1:
            raise ValueError("the mixture draws no task a step")
        self.seed = int(seed)
        self.tasks = [t for _, tasks, _ in self.pools for t in tasks]  # every task it can start
        blob = json.dumps([[n, c, [_task_json(t) for t in ts]] for n, ts, c in self.pools] + [self.seed])
        self.fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:16]
        self.heldout: dict[str, int] = {}  # pool -> tasks its manifest keeps for evaluation (not drawn)
        self._next = 0
        self._cache: tuple[int, list[Task]] | None = None

    def step_tasks(self, step: int) -> list[Task]:
        """The task starts of step `step` (pool order, draws with replacement)."""
        if self._cache and self._cache[0] == step:
            return self._cache[1]
        out: list[Task] = []
        for i, (_, tasks, count) in enumerate(self.pools):
            if count:
                rng = np.random.default_rng(np.random.SeedSequence([self.seed, i, step]))
                out += [tasks[int(j)] for j in rng.integers(0, len(tasks), size=count)]
        self._cache = (step, out)
        return out

    def next_task(self) -> Task:
        step, slot = divmod(self._next, self.step_size)
        self._next += 1
        return self.step_tasks(step)[slot]

    def next_step(self) -> list[Task]:
        return [self.next_task() for _ in range(self.step_size)]

    def peek_step(self) -> list[Task]:
        """The task starts `next_step` will return, without drawing them (the draws are a pure
        function of (seed, pool, step), so the environment can start their servers early)."""
        return [self.step_tasks(i // self.step_size)[i % self.step_size]
                for i in range(self._next, self._next + self.step_size)]

    def get_state(self) -> dict[str, Any]:
        return {"next": self._next, "fingerprint": self.fingerprint}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError("task-mixture state comes from a different configuration (pools, admitted tasks, "
                             "counts or seed differ); restore with the same mixture, manifest and seed")
        self._next = int(state["next"])

    state_dict = get_state
    load_state_dict = set_state


def pool_tasks(pool: str, directory: str, admitted: set[str] | None, *,
               conversational: Sequence[str] = ()) -> list[Task]:
    """The tasks of one pool directory, narrowed to the manifest's admitted ids. `conversational`:
    env.envscaler_conversational (EnvScaler only; envs/envscaler/mode.py)."""
    if pool == "awm":
        from actionopd_jax.envs.awm.layout import load_awm

        tasks = load_awm(directory).tasks()
    elif pool == "envscaler":
        from actionopd_jax.envs.envscaler.layout import load_envscaler

        tasks = load_envscaler(directory, conversational=conversational).tasks()
    else:
        raise ValueError(f"unknown pool {pool!r}; expected one of {POOLS}")
    return tasks if admitted is None else [t for t in tasks if t.task_id in admitted]


def mixture_entries(env: Any) -> list[tuple[str, int]]:
    """The `env` section's mixture: env.mixture, or the whole step from env.name's pool."""
    if env.mixture:
        return parse_mixture(env.mixture)
    if env.name in POOLS:
        return [(env.name, 1)]
    raise ValueError(f"env.name={env.name!r} has no task pools; set env.mixture or env.name awm / envscaler")


def mixture_pool_tasks(env: Any) -> dict[str, list[Task]]:
    """Pool -> the tasks the run may start: env.*_dir's tasks admitted by env.manifest (written by
    `actionopd envs audit`), minus the manifest's held-out split and env.heldout_task_ids (tasks
    kept for evaluation are never drawn)."""
    from actionopd_jax.config import ConfigError
    from actionopd_jax.envs.admission import read_manifest
    from actionopd_jax.envs.envscaler.mode import UnknownScenarioIds

    entries = mixture_entries(env)
    if not env.manifest:
        raise ConfigError("training on the AWM / EnvScaler pools reads the admitted tasks from env.manifest; "
                          "write one with `actionopd envs audit --env <pool> --dir DIR --manifest FILE`")
    try:
        manifest = read_manifest(env.manifest)
    except (OSError, ValueError) as err:
        raise ConfigError(f"env.manifest={env.manifest}: not readable as an admission manifest ({err}); write one "
                          "with `actionopd envs audit --env <pool> --dir DIR --manifest FILE`") from None
    admitted, heldout = manifest["admitted"], manifest["heldout"]
    own_heldout = set(env.heldout_task_ids)
    out: dict[str, list[Task]] = {}
    for pool, _ in entries:
        directory = env.awm_dir if pool == "awm" else env.envscaler_dir
        if not directory:
            raise ConfigError(f"env.mixture draws from {pool} but env.{pool}_dir is not set")
        if pool not in admitted:
            raise ConfigError(f"env.manifest={env.manifest} has no admitted tasks for pool {pool!r}; audit it first")
        try:
            tasks = pool_tasks(pool, directory, None, conversational=env.envscaler_conversational)
        except UnknownScenarioIds as err:
            raise ConfigError(f"env.envscaler_conversational names {len(err.ids)} task id(s) that are not scenarios "
                              f"of env.envscaler_dir={directory}: {err.ids[:10]}; list `task_id`s of its scenario "
                              "records, or give all / none") from None
        except (FileNotFoundError, ValueError, KeyError) as err:
            raise ConfigError(f"env.{pool}_dir={directory}: cannot load it as an {pool} pool: {err}") from None
        stray = sorted(admitted[pool] - {t.task_id for t in tasks})
        if stray:
            raise ConfigError(f"env.manifest={env.manifest} admits {len(stray)} {pool} task(s) that are not in "
                              f"env.{pool}_dir={directory} (e.g. {stray[:3]}): it was written for another "
                              "directory; audit this one")
        # held-out tasks (the manifest's evaluation split, env.heldout_task_ids) are never drawn
        skip = heldout.get(pool, set()) | own_heldout
        out[pool] = [t for t in tasks if t.task_id in admitted[pool] and t.task_id not in skip]
        if not out[pool]:
            raise ConfigError(_no_tasks_to_draw(pool, env.manifest, directory, manifest["pools"].get(pool),
                                                len(admitted[pool])))
    return out


def _no_tasks_to_draw(pool: str, manifest: str, directory: str, entry: Any, n_admitted: int) -> str:
    """Why a pool the run draws from has no task to start (issue 46 item 10: it surfaced as a
    ValueError traceback from the stream), naming the stage that dropped its last task and the
    two commands that decide admission: the audit and the B.1 screen."""
    if n_admitted:
        why = (f"all {n_admitted} of its admitted tasks are held out for evaluation (the manifest's held-out "
               "split and env.heldout_task_ids); audit with a smaller --heldout-fraction or drop ids from "
               "env.heldout_task_ids")
    else:
        stage = next((row.get("stage") for row in (entry or {}).get("funnel") or []
                      if isinstance(row, dict) and row.get("kept") == 0), None)
        why = "it admits none of the pool's tasks" + (f" (every task was dropped at {stage!r})" if stage else "")
    return (f"pool {pool!r} has no tasks to train on but env.name / env.mixture draws from it: "
            f"env.manifest={manifest}: {why}. The manifest's \"dropped\" gives each task's reason; fix the pool or "
            f"its setup, then rerun the admission audit (`actionopd envs audit --env {pool} --dir {directory} "
            f"--manifest {manifest}`) and the B.1 feasibility screen (`actionopd envs screen --env {pool} "
            f"--manifest {manifest} --judge-url U --judge-model J`), or remove {pool} from env.mixture")


def missing_pool_files(env: Any) -> list[str]:
    """The pool paths the `env` section names when this host has none of them (a planning host
    for `train --check` has no pool data); [] when any is present, so that a half-present setup
    (a pool directory without its manifest) is checked, and refused, as the run would."""
    from pathlib import Path

    pools = [p for p, _ in mixture_entries(env)]
    paths = [("env.manifest", env.manifest)] + [(f"env.{p}_dir", getattr(env, f"{p}_dir")) for p in pools]
    named = [(key, value) for key, value in paths if value]
    if not named or any(Path(value).exists() for _, value in named):
        return []
    return [f"{key}={value}" for key, value in named]


def mixture_stream_from(env: Any, *, per_step: int, seed: int) -> MixtureStream:
    """The run's mixture stream: each pool's training tasks (mixture_pool_tasks), the counts of
    env.mixture scaled to `per_step`."""
    from actionopd_jax.envs.admission import read_manifest

    entries = mixture_entries(env)
    by_pool = mixture_pool_tasks(env)
    counts = scale_counts([c for _, c in entries], per_step)
    stream = MixtureStream([(pool, by_pool[pool], count) for (pool, _), count in zip(entries, counts)], seed=seed)
    heldout = read_manifest(env.manifest)["heldout"]
    stream.heldout = {pool: len(heldout.get(pool, set())) for pool, _ in entries}
    return stream


def mixture_summary(stream: MixtureStream) -> str:
    """'pools      awm 12 admitted (59/step), envscaler 6 admitted (5/step)' for --check."""
    held = stream.heldout
    parts = [f"{name} {len(tasks)} admitted ({count}/step)" + (f", {held[name]} held out for eval" if held.get(name)
                                                              else "") for name, tasks, count in stream.pools]
    return "pools      " + ", ".join(parts) + "; drawn with replacement"
