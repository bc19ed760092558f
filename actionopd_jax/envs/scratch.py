"""Per-process scratch directories that outlive nothing but a `kill -9`, and not for long.

A trainer killed with -9 cannot remove its directories. Its sandboxed servers die with it
(parent-death signal, pid namespace: docs/environments.md), but their working directories stay
in the temp dir: AWM's episode databases, the servers' code and stderr files, EnvScaler's
sessions. A preempted run restarted a few times a day would fill /tmp with them. (The
matcher's fork directories have their own sweep, by pid: envs/fork.py.)

So each process keeps such directories under one directory of its own, `<base>/<pid>`, and
holds an exclusive `flock` on it for as long as it lives. The kernel drops that lock when the
process dies, however it dies, so the first `owned_dir(base)` of a later process removes every
`<base>/<pid>` whose pid is not alive here and whose lock it can take. Both: the lock alone
would let a sweeper remove a directory made a moment before its owner locks it; the pid alone
would remove the live directory of a process in another pid namespace sharing the temp dir (a
container), invisible to `kill(pid, 0)` but not to its lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading
from pathlib import Path

_lock = threading.Lock()
_mine: dict[tuple[str, int], tuple[Path, int]] = {}   # (base, pid) -> (this process's dir, its locked fd)


def _held_by_someone(path: Path) -> bool:
    """Whether a live process holds `path`'s lock (the directory of a dead owner is free)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return True   # gone already, or not ours to open: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)   # closing drops a lock this call took
    return False


def pid_alive(pid: int) -> bool:
    """Whether `pid` names a live process in this pid namespace (also envs/fork.py's sweep)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # someone else's live process
    return True


def owned_dir(base: str | Path) -> Path:
    """This process's directory under `base` (made, and locked, once per process), after
    removing the directories under `base` of owners that are gone (module docstring)."""
    base = Path(base)
    key = (str(base), os.getpid())   # a forked child gets a directory of its own
    with _lock:
        if key not in _mine:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
            for entry in base.iterdir():
                if entry.name.isdigit() and not pid_alive(int(entry.name)) and not _held_by_someone(entry):
                    shutil.rmtree(entry, ignore_errors=True)
            mine = base / str(os.getpid())
            mine.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(mine, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # held until this process ends
            _mine[key] = (mine, fd)
        return _mine[key][0]


def scratch_dir() -> Path:
    """This process's scratch directory for sandbox working directories and AWM's code and
    episode databases: `<tmp>/actionopd-scratch-<uid>/<pid>` (per user: a 0700 directory of one
    user would refuse another's on a shared host)."""
    return owned_dir(Path(tempfile.gettempdir()) / f"actionopd-scratch-{os.getuid()}")
