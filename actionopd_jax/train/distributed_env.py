"""Multi-process JAX settings passed to the trainer through environment variables.

The launchers (actionopd_jax/launch/) write these variables and the trainer reads them, so
the names and their parsing live here, below both.

On TPU pods `jax.distributed.initialize()` finds everything itself. On GPU hosts (and for
local CPU simulation) JAX needs the coordinator address, the process count and this process's
id; launchers set them as

    ACTIONOPD_COORDINATOR        host:port of process 0's coordinator service
    ACTIONOPD_NUM_PROCESSES      total number of processes (one per host)
    ACTIONOPD_PROCESS_ID         this process's id in [0, ACTIONOPD_NUM_PROCESSES)
    ACTIONOPD_LOCAL_DEVICE_IDS   optional, comma-separated local device ids this process owns

and the trainer reads them in `train/distributed.initialize`. `initialize_from_env()` is the
same start-up for a script of one's own: call it before touching any device.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

COORDINATOR_ENV = "ACTIONOPD_COORDINATOR"
NUM_PROCESSES_ENV = "ACTIONOPD_NUM_PROCESSES"
PROCESS_ID_ENV = "ACTIONOPD_PROCESS_ID"
LOCAL_DEVICE_IDS_ENV = "ACTIONOPD_LOCAL_DEVICE_IDS"
_REQUIRED = (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    coordinator: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        host, sep, port = self.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{COORDINATOR_ENV}={self.coordinator!r} must be host:port")
        if self.num_processes < 1:
            raise ValueError(f"{NUM_PROCESSES_ENV} must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"{PROCESS_ID_ENV}={self.process_id} must be in "
                             f"[0, {self.num_processes}) ({NUM_PROCESSES_ENV}={self.num_processes})")

    def to_env(self) -> dict[str, str]:
        env = {COORDINATOR_ENV: self.coordinator, NUM_PROCESSES_ENV: str(self.num_processes),
               PROCESS_ID_ENV: str(self.process_id)}
        if self.local_device_ids is not None:
            env[LOCAL_DEVICE_IDS_ENV] = ",".join(map(str, self.local_device_ids))
        return env

    def config_fields(self) -> dict:
        """Same settings named as the trainer's `run.distributed` config fields, so the trainer
        can fill an unset DistributedConfig: `dataclasses.replace(cfg, **s.config_fields())`."""
        return dict(coordinator_address=self.coordinator, num_processes=self.num_processes,
                    process_id=self.process_id)

    def init_kwargs(self) -> dict:
        """Keyword arguments for `jax.distributed.initialize`."""
        kwargs = dict(coordinator_address=self.coordinator, num_processes=self.num_processes,
                      process_id=self.process_id)
        if self.local_device_ids is not None:
            kwargs["local_device_ids"] = list(self.local_device_ids)
        return kwargs


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def settings_from_env(environ: Mapping[str, str] | None = None) -> DistributedSettings | None:
    """The settings in the environment, or None when none of the variables is set.

    Setting only some of them is an error (a half-configured job would otherwise hang
    waiting for peers or silently train alone).
    """
    environ = os.environ if environ is None else environ
    present = [name for name in _REQUIRED if environ.get(name)]
    if not present:
        return None
    missing = [name for name in _REQUIRED if not environ.get(name)]
    if missing:
        raise ValueError(f"multi-process settings incomplete: {', '.join(present)} set but "
                         f"{', '.join(missing)} missing; set all of {', '.join(_REQUIRED)} or none")
    device_ids = None
    if environ.get(LOCAL_DEVICE_IDS_ENV):
        try:
            device_ids = tuple(int(x) for x in environ[LOCAL_DEVICE_IDS_ENV].split(","))
        except ValueError:
            raise ValueError(f"{LOCAL_DEVICE_IDS_ENV}={environ[LOCAL_DEVICE_IDS_ENV]!r} must be "
                             "comma-separated integers") from None
    return DistributedSettings(coordinator=environ[COORDINATOR_ENV],
                               num_processes=_int(environ, NUM_PROCESSES_ENV),
                               process_id=_int(environ, PROCESS_ID_ENV),
                               local_device_ids=device_ids)


def initialize_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Call `jax.distributed.initialize` with the ACTIONOPD_* settings if they are set.

    Returns True if it initialised, False when the variables are absent (single process, or
    a TPU pod where the trainer calls `jax.distributed.initialize()` without arguments). As
    the trainer does, it then turns the persistent compile cache off on a CPU cluster
    (compile_cache.off_for_cpu_cluster: there a rerun's processes would mix loaded and
    compiled programs).
    """
    settings = settings_from_env(environ)
    if settings is None:
        return False
    import logging

    import jax

    from actionopd_jax.compile_cache import off_for_cpu_cluster

    jax.distributed.initialize(**settings.init_kwargs())
    note = off_for_cpu_cluster()
    if note:
        logging.getLogger(__name__).info(note)
    return True
