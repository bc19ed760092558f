"""Task records and the task-start pipeline (grain).

Each training step starts a fixed number of tasks from each source (the paper mixes 59 + 5 per
step; ours is configurable). Every source is shuffled with its own seed (derived from the run
seed and the source's position) and repeated, reshuffled each epoch. Global task index `j`
maps to step `j // step_size` and a slot within it, so the stream is pure random access: its
whole state is the next index, and a restored run continues with the next task start.

Checkpointing: `stream.iterator` is a grain `DatasetIterator`; save it with Orbax through
grain's handler (`grain.checkpoint.CheckpointSave(stream.iterator)` inside `ocp.args.Composite`),
or use `stream.get_state()` / `set_state()` (plain JSON, with a fingerprint of the config).
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any, Sequence

import grain
import numpy as np

from actionopd_jax.types import Task


def task_record(task: Task) -> dict[str, Any]:
    return {"task_id": task.task_id, "env": task.env, "split": task.split, "payload": task.payload}


def task_from_record(record: dict[str, Any]) -> Task:
    return Task(task_id=record["task_id"], env=record["env"], split=record["split"], payload=dict(record["payload"]))


def load_task_set(env: str, split: str) -> list[Task]:
    """Tasks of one environment: env "bfcl" with split = a category ("base", ...) or "all";
    env "tau2_<domain>" with split "train" / "test" / "base"."""
    if env == "bfcl":
        from actionopd_jax.envs.bfcl_data import CATEGORIES, bfcl_tasks

        return bfcl_tasks(CATEGORIES if split == "all" else [split])
    if env.startswith("tau2_"):
        from actionopd_jax.envs.tau2_tasks import tau2_tasks

        return tau2_tasks(env[len("tau2_"):], split)
    raise ValueError(f"unknown environment '{env}'; expected bfcl or tau2_<airline|retail|telecom>")


class TaskSource:
    """A grain random-access source of task records (JSON-able dicts). Its repr names the
    content by hash, so it is stable across processes and runs."""

    def __init__(self, name: str, tasks: Sequence[Task]):
        if not tasks:
            raise ValueError(f"task source '{name}' is empty")
        self.name = name
        self._records = tuple(task_record(t) for t in tasks)
        blob = json.dumps(self._records, sort_keys=True).encode()
        self.digest = hashlib.sha256(blob).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return json.loads(json.dumps(self._records[index]))  # a private copy per read

    def __repr__(self) -> str:
        return f"TaskSource(name={self.name!r}, size={len(self)}, sha256={self.digest})"


class _QuotaMix(grain.MapDataset):
    """Infinite mix: each step holds `quotas[i]` consecutive elements from parent i."""

    def __init__(self, parents: list[grain.MapDataset], quotas: list[int]):
        super().__init__(parents)
        self._quotas = list(quotas)
        self._offsets = np.cumsum([0] + self._quotas[:-1]).tolist()
        self._step = sum(self._quotas)

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        step, slot = divmod(int(index), self._step)
        for parent, quota, offset in zip(self._parents, self._quotas, self._offsets):
            if slot < offset + quota:
                return parent[step * quota + (slot - offset)]
        raise AssertionError("slot outside the step")

    def __str__(self) -> str:
        return f"QuotaMix(quotas={self._quotas})"


def _source_seed(seed: int, position: int) -> int:
    return int(np.random.SeedSequence([seed, position]).generate_state(1, np.uint32)[0])


class TaskStream:
    """Task starts for training, `step_size = sum(quotas)` per step, checkpointable."""

    def __init__(self, quotas: Sequence[tuple[TaskSource, int]], *, seed: int):
        if not quotas:
            raise ValueError("TaskStream needs at least one (source, per_step) pair")
        for source, per_step in quotas:
            if not isinstance(source, TaskSource):
                raise TypeError(f"expected a TaskSource, got {type(source).__name__}")
            if not isinstance(per_step, int) or per_step < 1:
                raise ValueError(f"per-step quota for '{source.name}' must be a positive int, got {per_step!r}")
        parents = [
            grain.MapDataset.source(source).shuffle(seed=_source_seed(seed, i)).repeat(None)
            for i, (source, _) in enumerate(quotas)
        ]
        self.step_size = sum(q for _, q in quotas)
        # every task the stream can start (what a run records as its training tasks)
        self.tasks = [task_from_record(source[i]) for source, _ in quotas for i in range(len(source))]
        self.fingerprint = hashlib.sha256(
            json.dumps([[repr(s), q] for s, q in quotas] + [seed]).encode()
        ).hexdigest()[:16]
        dataset = _QuotaMix(parents, [q for _, q in quotas]).map(task_from_record)
        # No worker threads: task records are tiny, and a single-threaded iterator keeps the
        # checkpointed index exactly the next task to start.
        self.iterator = iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))

    def next_task(self) -> Task:
        return next(self.iterator)

    def next_step(self) -> list[Task]:
        """The task starts of one training step, in source order."""
        return [self.next_task() for _ in range(self.step_size)]

    def get_state(self) -> dict[str, Any]:
        state = dict(self.iterator.get_state())
        state["fingerprint"] = self.fingerprint
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint", self.fingerprint) != self.fingerprint:
            raise ValueError(
                "task-stream state comes from a different configuration (sources, quotas or seed differ); "
                "restore with the same task sources, quotas and seed"
            )
        self.iterator.set_state({k: v for k, v in state.items() if k != "fingerprint"})
