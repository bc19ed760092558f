"""envs/scratch.py: a process's scratch directory is kept while its owner lives (its pid is
alive, or it holds the directory's lock) and removed by the next process's first use once the
owner is gone. The kill -9 of a trainer with live AWM servers: tests/test_env_awm.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from actionopd_jax.envs.scratch import owned_dir

ROOT = Path(__file__).parents[1]
HOLD = """
import fcntl, os, sys, time
sys.path.insert(0, sys.argv[1])
from actionopd_jax.envs.scratch import owned_dir
mine = owned_dir(sys.argv[2])
(mine / "work.db").write_text("x")
# as a process in another pid namespace would look from here: a pid that is not alive, locked
foreign = os.path.join(sys.argv[2], sys.argv[3])
os.mkdir(foreign)
fd = os.open(foreign, os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print(mine, flush=True)
time.sleep(600)
"""
NO_SUCH_PID = 4_194_000   # above any pid this host hands out (pid_max is at most 4,194,304)


def test_live_owners_directories_are_kept_and_a_dead_unlocked_ones_removed(tmp_path):
    base = tmp_path / "scratch"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(ROOT), str(base), str(NO_SUCH_PID)],
                              stdout=subprocess.PIPE, text=True)
    try:
        held = Path(holder.stdout.readline().strip())
        assert held == base / str(holder.pid)
        dead = base / str(NO_SUCH_PID + 1)   # no such process, no lock: a kill -9's leftovers
        (dead / "sub").mkdir(parents=True)
        (dead / "sub" / "episode.db").write_text("x")
        unlocked_live = base / "1"   # pid 1 is alive (not locked yet: made a moment ago, say)
        unlocked_live.mkdir()
        other = base / "not-a-pid"
        other.mkdir()
        mine = owned_dir(base)
        assert mine == base / str(os.getpid()) and mine.is_dir()
        assert owned_dir(base) == mine   # once per process: no second sweep, the same directory
        assert (held / "work.db").read_text() == "x"   # its owner is alive
        assert (base / str(NO_SUCH_PID)).is_dir()   # dead by its pid here, but its lock is held
        assert unlocked_live.is_dir() and other.is_dir()   # a live pid, and not a pid
        assert not dead.exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: the next process's first use removes its directory
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from actionopd_jax.envs.scratch "
                    "import owned_dir; owned_dir(sys.argv[2])", str(ROOT), str(base)], check=True, timeout=60)
    assert not held.exists() and (base / str(os.getpid())).is_dir()   # and ours, locked, stays
