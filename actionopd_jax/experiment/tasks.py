"""The main job's tasks: a BFCL multi-turn subset and its deterministic train / held-out split.

Subset: the tasks of one category whose involved classes are exactly `bfcl_classes` (e.g.
the 21 single-class TradingBot base tasks). One tool class keeps every prompt at one short
tool schema (~2.5k tokens with the job's tokenizer, against 3-7k for multi-class tasks), which
is what makes a CPU run of minutes possible.

Split: tasks ordered by sha256(task id); the first round(fraction * n) are held out. It depends
on the task ids only (not on the seed or on dataset order), so every run and every machine
holds out the same tasks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from actionopd_jax.types import Task


@dataclass(frozen=True)
class TaskSplit:
    train: list[Task]
    heldout: list[Task]
    pool_size: int  # tasks of the subset before max_* limits


def subset_tasks(category: str, classes: tuple[str, ...] | list[str]) -> list[Task]:
    """BFCL tasks of `category` whose involved classes are exactly `classes` (any order)."""
    from actionopd_jax.envs.bfcl_data import CATEGORIES, bfcl_tasks, load_entry

    if category not in CATEGORIES:
        raise ValueError(f"experiment.bfcl_category={category!r}; choose one of {list(CATEGORIES)}")
    wanted = sorted(classes)
    out = [t for t in bfcl_tasks((category,)) if sorted(load_entry(t.task_id)["involved_classes"]) == wanted]
    if not out:
        raise ValueError(f"no BFCL {category} task uses exactly the classes {wanted}; "
                         "pick classes that occur together (e.g. [TradingBot] or [VehicleControlAPI])")
    return out


def _order_key(task: Task) -> str:
    return hashlib.sha256(task.task_id.encode()).hexdigest()


def split_tasks(tasks: list[Task], heldout_fraction: float, *, max_train: int = 0, max_heldout: int = 0) -> TaskSplit:
    """Deterministic split by task id (see the module docstring); limits keep the first tasks
    of each side in that order (0: all). Both sides are returned in dataset order."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if len(tasks) < 2:
        raise ValueError(f"need at least 2 tasks to hold some out, got {len(tasks)}")
    ordered = sorted(tasks, key=_order_key)
    n_held = min(len(tasks) - 1, max(1, round(heldout_fraction * len(tasks))))
    held, train = ordered[:n_held], ordered[n_held:]
    held = held[: max_heldout or None]
    train = train[: max_train or None]
    position = {t.task_id: i for i, t in enumerate(tasks)}
    return TaskSplit(train=sorted(train, key=lambda t: position[t.task_id]),
                     heldout=sorted(held, key=lambda t: position[t.task_id]), pool_size=len(tasks))


def job_tasks(exp) -> TaskSplit:
    """The train / held-out tasks of the main job's `experiment` settings."""
    return split_tasks(subset_tasks(exp.bfcl_category, tuple(exp.bfcl_classes)), exp.heldout_fraction,
                       max_train=exp.max_train_tasks, max_heldout=exp.max_heldout_tasks)


def opening_collisions(tasks: list[Task]) -> list[list[str]]:
    """Groups of tasks that share their first user message. The reference teacher recognises
    a BFCL task by that message when the teacher client sends no task id, so the tasks it
    serves must have distinct openings."""
    from actionopd_jax.envs.bfcl_data import load_entry

    seen: dict[str, list[str]] = {}
    for t in tasks:
        first = load_entry(t.task_id)["question"][0]
        text = next((m.get("content") for m in first if m.get("role") == "user"), "")
        seen.setdefault(str(text), []).append(t.task_id)
    return [ids for ids in seen.values() if len(ids) > 1]
