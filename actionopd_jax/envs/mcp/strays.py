"""Ending the processes a tool left behind, between two episodes on one pooled server.

A pooled server is reset in place (its database copied back, a reset tool, a reset command),
so without this a tool that forks a child, or a daemon (double fork + `setsid`), leaves it
running into the next episodes (issue 34: for ~28 s, until a hang replaced the server).

Every sandboxed server runs in a private pid namespace (launcher.py) whose init reaps orphans.
Right after the server starts, the pool records which processes that namespace holds (the
server and whatever it started itself); at each reset, every other process of the namespace is
killed, by pid and start time (a pid reused after one of the recorded processes ended is not
mistaken for it). Read from the host's /proc: a namespace is the `ns/pid` link every member
shares, which the trainer may read for the namespaces it created.
"""

from __future__ import annotations

import os
import select
import signal
import time

# How many kill-and-rescan rounds a reset tries before it gives up on the server (a process
# forking as fast as it is killed): the pool then replaces the server instead.
MAX_ROUNDS = 50

Member = tuple[int, int]  # (host pid, start time in clock ticks since boot)


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state letter, start time) of a live /proc entry, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parens
    return int(fields[1]), fields[0], int(fields[19])


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def namespace_of(launcher_pid: int) -> str | None:
    """The pid namespace of the launcher's child (the namespace's init), or None when the
    launcher has no child in a namespace of its own (no pid namespace: nothing to scan)."""
    own = _pid_namespace(launcher_pid)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _stat(int(entry))
            if info is not None and info[0] == launcher_pid:
                ns = _pid_namespace(int(entry))
                if ns is not None and ns != own:
                    return ns
    return None


def members(namespace: str) -> set[Member]:
    """The live (not zombie) processes of a pid namespace, as (pid, start time)."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if _pid_namespace(pid) != namespace:
            continue
        info = _stat(pid)
        if info is not None and info[1] != "Z":
            out.add((pid, info[2]))
    return out


def _kill(pid: int, start: int) -> int | None:
    """A pidfd of the process, SIGKILLed, or None when it is gone (or its pid now names a
    newer process). Through a pidfd, so the signal cannot reach a process that took the pid."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return None
    info = _stat(pid)
    if info is None or info[2] != start:
        os.close(fd)
        return None
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        os.close(fd)
        return None
    return fd


def end_strays(namespace: str, keep: set[Member], *, wait_s: float = 5.0) -> int | None:
    """SIGKILL every live process of `namespace` not in `keep`, wait for each to die, and scan
    again until none is left; the number killed, or None when new ones kept appearing for
    MAX_ROUNDS scans or one did not die within `wait_s` (then replace the server)."""
    killed = 0
    for _ in range(MAX_ROUNDS):
        fds = [fd for fd in (_kill(pid, start) for pid, start in members(namespace) - keep) if fd is not None]
        if not fds:
            return killed
        killed += len(fds)
        try:
            # a pidfd reads as ready once its process has exited
            deadline = time.monotonic() + wait_s
            waiting = list(fds)
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                ready, _, _ = select.select(waiting, [], [], left)
                waiting = [fd for fd in waiting if fd not in ready]
        finally:
            for fd in fds:
                os.close(fd)
    return None
