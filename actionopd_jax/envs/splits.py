"""Which tasks a run trains on, which tasks evaluation scores, and the rule between them.

BFCL multi-turn has no training split: all 800 tasks (4 categories x 200) are what `actionopd
eval --bench bfcl` scores, and the paper only evaluates on it. tau2 has official splits (178
train / 100 test over airline, retail, telecom); `eval --bench tau2_<domain>` scores the test
split. Training on tasks that evaluation scores makes the evaluation meaningless, so it is
refused unless the config says so (`env.allow_eval_overlap: true`).

A run may instead name its own split: `env.task_ids` (what it trains on) and
`env.heldout_task_ids` (what its own evaluation scores, e.g. the main job's 13 / 7 TradingBot
tasks). A disjoint explicit pair is accepted without the opt-in.

Every training run writes the ids it trains on to `<run dir>/train_tasks.json`;
`eval_overlap_warning` tells `eval` when it scores some of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from actionopd_jax.config import EnvConfig
from actionopd_jax.types import Task

TRAIN_TASKS_FILE = "train_tasks.json"


def _config_error(message: str) -> Exception:
    from actionopd_jax.config import ConfigError

    return ConfigError(message)


def benchmark_of(env: str) -> str:
    """'bfcl' -> 'BFCL multi-turn'; 'tau2_retail' -> 'tau2 retail'."""
    if env == "bfcl":
        return "BFCL multi-turn"
    if env.startswith("tau2_"):
        return f"tau2 {env[len('tau2_'):]}"
    return env


def scored_task_ids(env: str) -> frozenset[str]:
    """The task ids `actionopd eval` scores for an environment by default: every BFCL task, the
    official test split of a tau2 domain; nothing for other environments."""
    if env == "bfcl":
        from actionopd_jax.envs.bfcl_data import task_ids

        return frozenset(task_ids())
    if env.startswith("tau2_"):
        from actionopd_jax.envs.tau2_tasks import tau2_tasks

        return frozenset(t.task_id for t in tau2_tasks(env[len("tau2_"):], "test"))
    return frozenset()


@dataclass(frozen=True)
class Overlap:
    """Training tasks that evaluation scores, per benchmark."""

    by_benchmark: dict[str, list[str]]
    against: str  # what they were compared with (the benchmarks' eval sets or env.heldout_task_ids)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.by_benchmark.values())

    def describe(self) -> str:
        parts = [f"{len(ids)} {b} task(s) (e.g. {', '.join(ids[:3])})" for b, ids in self.by_benchmark.items()]
        return "; ".join(parts)


def find_overlap(env_cfg: EnvConfig, tasks: Iterable[Task]) -> Overlap:
    """The training `tasks` that evaluation scores: compared with `env.heldout_task_ids` when the
    config names its own held-out tasks, else with each benchmark's eval set (scored_task_ids)."""
    heldout = frozenset(env_cfg.heldout_task_ids)
    by: dict[str, list[str]] = {}
    cache: dict[str, frozenset[str]] = {}
    for t in tasks:
        scored = heldout if heldout else cache.setdefault(t.env, scored_task_ids(t.env))
        if t.task_id in scored:
            by.setdefault(benchmark_of(t.env), []).append(t.task_id)
    return Overlap(by, "env.heldout_task_ids" if heldout else "the tasks `actionopd eval` scores")


def check_eval_overlap(env_cfg: EnvConfig, tasks: Sequence[Task]) -> Overlap:
    """Refuse (ConfigError) training on tasks evaluation scores unless env.allow_eval_overlap;
    returns the overlap (empty, or accepted by the opt-in)."""
    overlap = find_overlap(env_cfg, tasks)
    if overlap.count and not env_cfg.allow_eval_overlap:
        advice = ("BFCL has no training split: name a disjoint split with env.task_ids (train) and "
                  "env.heldout_task_ids (held out), or"
                  if "BFCL multi-turn" in overlap.by_benchmark else
                  "use env.split=train (tau2's official 178-task training split), or")
        raise _config_error(
            f"the training tasks include {overlap.count} of {len(tasks)} that evaluation scores "
            f"({overlap.against}): {overlap.describe()}. Scores on them would not measure held-out "
            f"performance. {advice} set env.allow_eval_overlap: true to train on them anyway.")
    return overlap


def select_task_ids(tasks: list[Task], wanted: Sequence[str], *, where: str = "env.task_ids") -> list[Task]:
    """The tasks named by `wanted` (all when empty), in the order of `tasks`; an id that is not
    among them is an error naming it."""
    if not wanted:
        return tasks
    have = {t.task_id for t in tasks}
    missing = [i for i in wanted if i not in have]
    if missing:
        raise _config_error(f"{where}: {len(missing)} id(s) are not tasks of the configured env.name / "
                            f"env.domains / env.split: {missing[:5]}")
    keep = set(wanted)
    return [t for t in tasks if t.task_id in keep]


def overlap_summary(env_cfg: EnvConfig, tasks: Sequence[Task]) -> str:
    """One line for `train --check`: how many tasks the run trains on and the eval overlap."""
    overlap = find_overlap(env_cfg, tasks)
    head = f"{len(tasks)} training task(s)"
    if env_cfg.heldout_task_ids:
        head += f", {len(env_cfg.heldout_task_ids)} held out (env.heldout_task_ids)"
    if not overlap.count:
        return f"{head}; " + ("disjoint from the held-out tasks" if env_cfg.heldout_task_ids
                              else "none of them is scored by `actionopd eval`")
    state = "ALLOWED by env.allow_eval_overlap: true" if env_cfg.allow_eval_overlap else "REFUSED"
    return f"{head}; {overlap.count} are scored by evaluation ({overlap.describe()}): {state}"


# --- the record in the run directory, and eval's warning -----------------------------------------

def record_train_tasks(run_dir: str | Path, tasks: Sequence[Task]) -> Path:
    """Write the ids of the training tasks to `<run_dir>/train_tasks.json` (atomically)."""
    path = Path(run_dir) / TRAIN_TASKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    pairs = sorted({(t.env, t.task_id) for t in tasks})
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"tasks": [{"env": e, "task_id": i} for e, i in pairs]}, indent=1) + "\n")
    tmp.replace(path)
    return path


def find_train_record(model_path: str | Path, *, levels: int = 3) -> Path | None:
    """The run's train_tasks.json for a checkpoint / exported student: `model_path` or one of
    its parents (a run dir holds checkpoints/<step>/ and student_final/)."""
    p = Path(model_path).resolve()
    for _ in range(levels + 1):
        if (p / TRAIN_TASKS_FILE).is_file():
            return p / TRAIN_TASKS_FILE
        p = p.parent
    return None


def eval_overlap_warning(model_path: str | Path | None, tasks: Sequence[Task]) -> str | None:
    """A warning when the run that produced `model_path` trained on some of `tasks`; None when
    it did not or no record is found."""
    if not model_path:
        return None
    record = find_train_record(model_path)
    if record is None:
        return None
    trained = {(r["env"], r["task_id"]) for r in json.loads(record.read_text()).get("tasks", [])}
    hit = [t.task_id for t in tasks if (t.env, t.task_id) in trained]
    if not hit:
        return None
    return (f"WARNING: {len(hit)} of the {len(tasks)} evaluated tasks were training tasks of this run "
            f"({record}): {', '.join(hit[:5])}{' ...' if len(hit) > 5 else ''}. Their scores measure "
            "fit to the training set, not held-out performance.")
