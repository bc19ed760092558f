"""envs/scratch.py: a process's scratch directory is kept while its owner lives (it holds the
directory's lock) and removed by the next process's first use once the owner is gone, whatever
the pid says. The kill -9 of a trainer with live AWM servers: tests/test_env_awm.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from actionopd_jax.envs.scratch import owned_dir

ROOT = Path(__file__).parents[1]
HOLD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from actionopd_jax.envs.scratch import owned_dir
mine = owned_dir(sys.argv[2])
(mine / "work.db").write_text("x")
print(mine, flush=True)
time.sleep(600)
"""


def test_a_live_owners_directory_is_kept_and_an_unlocked_one_removed_even_under_a_live_pid(tmp_path):
    base = tmp_path / "scratch"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(ROOT), str(base)], stdout=subprocess.PIPE, text=True)
    try:
        held = Path(holder.stdout.readline().strip())
        assert held == base / str(holder.pid)
        # pid 1 is alive but holds no lock here (a reused pid, or an owner in another pid
        # namespace that died): its directory is removed; a lock, not kill(pid, 0), decides
        unlocked = base / "1"
        (unlocked / "sub").mkdir(parents=True)
        (unlocked / "sub" / "episode.db").write_text("x")
        other = base / "not-a-pid"
        other.mkdir()
        mine = owned_dir(base)
        assert mine == base / str(os.getpid()) and mine.is_dir()
        assert owned_dir(base) == mine   # once per process: no second sweep, the same directory
        assert (held / "work.db").read_text() == "x"   # its owner is alive
        assert not unlocked.exists() and other.is_dir()   # only <pid> directories are swept
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: the next process's first use removes its directory
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from actionopd_jax.envs.scratch "
                    "import owned_dir; owned_dir(sys.argv[2])", str(ROOT), str(base)], check=True, timeout=60)
    assert not held.exists() and (base / str(os.getpid())).is_dir()   # and ours, locked, stays
