"""Multi-process (multi-host) helpers: start-up and small host-side agreements.

JAX runs one process per host; every jitted call on the global mesh is a collective, so
all processes must agree on shapes before they call it. The helpers here exchange the
little host data that needs agreeing (row counts, bucket widths, a stop flag, the run's
timestamp) with `multihost_utils`; with one process they are plain local computations.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from actionopd_jax.config import DistributedConfig

log = logging.getLogger(__name__)


MODES: tuple[str, ...] = ("auto", "on", "off")  # run.distributed.mode


def _tpu_pod_env() -> bool:
    """True on a multi-host TPU slice (the TPU runtime lists every worker)."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h.strip()]) > 1


def initialize(cfg: DistributedConfig) -> bool:
    """Call `jax.distributed.initialize` when this is a multi-process job.

    Sources, first match wins: the config's explicit fields (coordinator_address,
    num_processes, process_id); the launchers' ACTIONOPD_* environment variables
    (actionopd_jax.train.distributed_env); a multi-host TPU slice (JAX detects the rest);
    mode "on" (JAX's cluster auto-detection). mode "off" never initializes. Must run before
    anything touches a JAX device. Returns whether it initialized.
    """
    if cfg.mode == "off":
        return False
    kwargs: dict = {"initialization_timeout": cfg.initialization_timeout_s}
    if cfg.coordinator_address:
        if cfg.num_processes <= 0 or cfg.process_id < 0:
            raise ValueError("run.distributed.coordinator_address is set, so num_processes (> 0) and "
                             "process_id (>= 0) must be set too")
        if cfg.process_id >= cfg.num_processes:
            raise ValueError(f"run.distributed.process_id={cfg.process_id} must be < num_processes="
                             f"{cfg.num_processes}")
        kwargs.update(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                      process_id=cfg.process_id)
    else:
        from actionopd_jax.train.distributed_env import settings_from_env

        env_settings = settings_from_env()
        if env_settings is not None:
            kwargs.update(env_settings.init_kwargs())
        elif cfg.mode == "auto" and not _tpu_pod_env():
            return False
    jax.distributed.initialize(**kwargs)
    log.info("jax.distributed initialized: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def is_primary() -> bool:
    return jax.process_index() == 0


def allgather(x: np.ndarray) -> np.ndarray:
    """[P, *x.shape]: every process's x (same shape and dtype on every process)."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is True on any process."""
    return bool(np.any(allgather(np.asarray([int(flag)], np.int32))))


def broadcast_int(value: int) -> int:
    """Process 0's value, on every process."""
    if jax.process_count() == 1:
        return int(value)
    return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int64)))


def allgather_json(obj) -> list:
    """Every process's JSON-serialisable object, in process order."""
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    lengths = allgather(np.asarray([len(data)], np.int64))[:, 0]
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(data)] = data
    gathered = allgather(padded)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(gathered, lengths)]


def sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
