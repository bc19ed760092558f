"""Containment of untrusted (machine-generated) environment server code: the parent half.

`Sandbox.spawn` starts a command through `launcher.py` (the child half, a fresh stdlib-only
interpreter that contains itself and then exec()s the command). What is enforced on Linux for
an unprivileged trainer, and what is not:

| measure | enforced | how / why not |
|---|---|---|
| secrets in the environment | yes | the server's environment is built from nothing: only `ENV_ALLOW` names copied from the trainer (PATH, LANG, ...) plus `extra_env`; no `*_API_KEY`, `*_TOKEN` or any other name reaches it |
| private working directory | yes | a fresh `mkdtemp` per server (cwd, HOME, TMPDIR), removed on close; the only host directory it may write |
| what it can read | only its view (view.py), where user + mount namespaces are available (they are here; else it does not run) | a new, empty root holding read-only binds of the system's program and library trees, a few /etc files, the interpreter's trees (prefixes) and this package, the modules the command imports from other `sys.path` / PYTHONPATH directories (each module or package alone, never the whole directory: imports.py), the command's own files and the caller's `read_only` paths; the writable working directory; a private memory-backed /tmp; a minimal /dev; its own /proc. The trainer's HOME, other 0600 files of the trainer's and the rest of /etc are absent (a namespaced process keeps the trainer's uid for permission checks, so read-only alone would not hide them) |
| writes outside the working directory | yes | everything in its view is read-only except the working directory and the private /tmp |
| missing namespaces | fails closed | the launcher exits 123 with a paragraph saying which namespace the kernel refused and how to allow it (`Limits(namespaces=False)` is the explicit, uncontained opt-out) |
| network | no network of their own, stdio servers and HTTP servers given our listening socket (`{fd}`: the published AWM form), where user + network namespaces are available (they are here) | a private network namespace holding only `lo`; a passed socket still accepts the trainer's connections; HTTP servers that bind their own `{port}` share the trainer's network (the trainer must reach their port), so for them it is not enforced |
| CPU time | yes | RLIMIT_CPU (SIGXCPU, then SIGKILL at the hard limit = same value) |
| memory | yes, per process | RLIMIT_AS (address space); children each get their own limit |
| file size | yes, per file | RLIMIT_FSIZE (SIGXFSZ kills a writer past it, stderr log included); total disk use of the directory is not bounded (no quota without root) |
| open files | yes | RLIMIT_NOFILE |
| number of processes | no | RLIMIT_NPROC counts every process of the uid (trainer threads included) and is ignored for root; forks are instead contained by the pid namespace and group kill below |
| process lifetime | yes | own session + process group (killed as a group on close); PR_SET_PDEATHSIG=SIGKILL on the launcher (re-checked against the parent pid to close the race); in a private pid namespace every process, forked or `setsid()`-escaped, dies with the namespace's init, which dies with the launcher, which dies with the trainer thread that spawned it, so a `kill -9` of the trainer leaves nothing. Between episodes on a pooled server, every process of its namespace that the server did not start itself (its children, its daemons: all but those present when it listed its tools) is killed before the reset (strays.py); where that cannot be done the server is replaced. The namespace's init is a reaper of the launcher's, so a killed daemon leaves no zombie |
| wall clock per tool call | yes | the MCP client's per-call timeout (`client.py`); the server is then killed and replaced |
| output volume | stdio: yes; HTTP: no | stdio lines longer than `max_line_bytes` end the connection (the reader never buffers more); stderr goes to a file under RLIMIT_FSIZE (Python servers ignore SIGXFSZ, so their writes past it fail with EFBIG); over HTTP the SDK's client refuses one server-sent event over 1 MiB, which ends the episode as `mcp_protocol_error` ("SSE stream failed ..."); a smaller reply is read whole, then a tool result is cut to 20,000 characters (convert.py) |
| clean-up of private directories | on close; after a `kill -9`, at the next process's first use | they live under the trainer's `<tmp>/actionopd-scratch-<uid>/<pid>`, which it holds locked while alive; a later process removes every such directory whose pid is gone and whose lock it can take (envs/scratch.py) |
| privilege escalation | yes | PR_SET_NO_NEW_PRIVS before exec |
| system calls (seccomp) | no | not installed; namespaces and rlimits only |

The death signal belongs to the spawning *thread*: servers must be spawned from a thread that
lives as long as they do (the pool's event-loop thread, `loop.py`).

Dataset code outside MCP servers (AWM verifiers, EnvScaler classes and checks; envs/sandbox.py)
starts through the same launcher with the same rows, except: CPU seconds are limited for
one-shot calls (verifiers, checks) but not for an EnvScaler class session (it lives one episode,
with a wall clock per call); its replies come through a pipe, capped at 8 MiB per reply there
(RLIMIT_FSIZE bounds files, not pipes); and its sessions are spawned from long-lived executor
threads (envs/envscaler/env.py), so a `kill -9` of the trainer leaves none of them either.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from actionopd_jax.envs.mcp import strays
from actionopd_jax.envs.mcp.view import read_only_paths
from actionopd_jax.envs.scratch import scratch_dir

LAUNCHER = Path(__file__).with_name("launcher.py")

# The only names copied from the trainer's environment (what an interpreter needs to run).
ENV_ALLOW: tuple[str, ...] = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH", "VIRTUAL_ENV",
                              "PYENV_VERSION", "PYENV_ROOT", "SSL_CERT_FILE")
# Names never passed on, even when `extra_env` names them (a config typo must not leak a key).
SECRET_MARKERS: tuple[str, ...] = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "AUTH")


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed server (each soft = hard). 0 disables one."""

    cpu_s: int = 600                 # CPU seconds per process (not wall clock)
    memory_mb: int = 4096            # address space per process
    file_mb: int = 64                # largest file a process may write
    open_files: int = 256
    namespaces: bool = True          # private user / pid / mount (/ network for stdio) namespaces
    tmp_mb: int = 256                # the private /tmp (memory-backed)
    max_line_bytes: int = 8 << 20    # one MCP message on stdout

    def rlimits(self) -> dict[str, int]:
        out = {}
        if self.cpu_s:
            out["RLIMIT_CPU"] = self.cpu_s
        if self.memory_mb:
            out["RLIMIT_AS"] = self.memory_mb << 20
        if self.file_mb:
            out["RLIMIT_FSIZE"] = self.file_mb << 20
        if self.open_files:
            out["RLIMIT_NOFILE"] = self.open_files
        return out


def scrubbed_env(extra: dict[str, str] | None = None, *, workdir: str) -> dict[str, str]:
    """The whole environment a server gets: allow-listed names, its own HOME/TMPDIR, `extra`."""
    env = {k: os.environ[k] for k in ENV_ALLOW if k in os.environ}
    env.update({"HOME": workdir, "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"})
    for key, value in (extra or {}).items():
        if any(m in key.upper() for m in SECRET_MARKERS):
            raise ValueError(f"refusing to pass {key!r} to a sandboxed server (looks like a secret)")
        env[key] = str(value)
    return env


@dataclass
class SandboxedProcess:
    """A running sandboxed command: its asyncio process, private directory and stderr log."""

    process: asyncio.subprocess.Process
    workdir: Path
    stderr_path: Path
    transport_error: str = ""  # set by the transport when the server broke the protocol
    namespace: str | None = None  # its pid namespace, once `record_baseline` ran
    baseline: set = field(default_factory=set)  # the processes it started itself (strays.py)
    _closed: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid  # == its process group id (the launcher calls setsid)

    def alive(self) -> bool:
        return self.process.returncode is None

    def stderr_tail(self, limit: int = 2000) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - limit))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def record_baseline(self) -> None:
        """Remember the processes of its pid namespace now (the server and what it started
        itself): a reset ends every other one (`end_strays`)."""
        self.namespace = strays.namespace_of(self.pid)
        self.baseline = strays.members(self.namespace) if self.namespace else set()

    def end_strays(self) -> bool:
        """Kill every process of its namespace not in the baseline (a tool's forked children,
        its daemons); False when that cannot be done (no pid namespace, no baseline, processes
        that would not die): the caller replaces the server instead. Blocks up to seconds."""
        if self.namespace is None or not self.alive():
            return False
        return strays.end_strays(self.namespace, self.baseline) is not None

    def kill(self) -> None:
        """SIGKILL the whole process group (synchronous, idempotent)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    async def close(self, *, remove_dir: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self.kill()
        try:
            await asyncio.wait_for(self.process.wait(), 5.0)
        except (asyncio.TimeoutError, ProcessLookupError):
            pass
        # close the pipes' transport now, on its loop (asyncio would otherwise close it from
        # the garbage collector, possibly after the pool's loop is gone)
        transport = getattr(self.process, "_transport", None)
        if transport is not None:
            transport.close()
        if remove_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            try:
                self.stderr_path.unlink()
            except OSError:
                pass


class Sandbox:
    """Spawns contained commands. `root`: where private directories go (default: the system
    temp dir)."""

    def __init__(self, limits: Limits | None = None, *, root: str | None = None,
                 extra_env: dict[str, str] | None = None, read_only: tuple[str, ...] = ()):
        self.limits = limits or Limits()
        self.root = root
        self.extra_env = dict(extra_env or {})
        self.read_only = tuple(read_only)  # host paths the command may read (its code, its data)
        scrubbed_env(self.extra_env, workdir="/")  # refuse secret-looking names at construction

    def new_workdir(self) -> Path:
        """A fresh private directory under `root`, else under this process's scratch directory
        (envs/scratch.py: what a `kill -9` leaves there, the next process removes)."""
        return Path(tempfile.mkdtemp(prefix="actionopd-mcp-", dir=self.root or scratch_dir()))

    def launcher_argv(self, argv: list[str], workdir: Path, *, network: bool) -> tuple[list[str], dict[str, str]]:
        """The argv (launcher + command) and the environment that start `argv` contained.
        `network`: the command must be reachable over the trainer's loopback (no netns)."""
        names = ["pidns", "mountns"] + ([] if network else ["netns"]) if self.limits.namespaces else []
        view = {"read_only": read_only_paths(argv, self.read_only), "writable": [str(workdir)],
                "tmp_mb": self.limits.tmp_mb}
        spec = {"parent": os.getpid(), "cwd": str(workdir), "namespaces": names, "view": view,
                "inner_id": os.geteuid() or 1000,
                "env": scrubbed_env(self.extra_env, workdir=str(workdir)), "rlimits": self.limits.rlimits()}
        full = [sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(spec), "--", *argv]
        # the launcher itself needs nothing from the environment (-I -S: no site, no PYTHON*)
        return full, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}

    async def spawn(self, argv: list[str], *, workdir: Path | None = None, network: bool = False,
                    stdio: bool = True, pass_fds: tuple[int, ...] = ()) -> SandboxedProcess:
        """Start `argv` contained, from the running loop's thread (the death signal's owner).
        stdio=True: stdin/stdout are pipes (an MCP stdio server); else both are /dev/null.
        `pass_fds`: descriptors the server inherits (a listening socket of ours)."""
        workdir = workdir or self.new_workdir()
        full, env = self.launcher_argv(list(argv), workdir, network=network)
        stderr_path = workdir.parent / f"{workdir.name}.stderr"  # outside the dir the server may list
        with open(stderr_path, "wb") as err:
            pipe = asyncio.subprocess.PIPE if stdio else asyncio.subprocess.DEVNULL
            process = await asyncio.create_subprocess_exec(
                *full, stdin=pipe, stdout=pipe, stderr=err, env=env, cwd=str(workdir),
                start_new_session=True, close_fds=True, pass_fds=pass_fds, limit=self.limits.max_line_bytes)
        return SandboxedProcess(process, workdir, stderr_path)

    async def run(self, argv: list[str], *, workdir: Path, timeout_s: float) -> tuple[int, str]:
        """Run a short command (a reset hook) contained in `workdir`; (exit code, stderr tail).
        Exit code -9 when it ran past `timeout_s` (then it is killed)."""
        proc = await self.spawn(argv, workdir=workdir, network=False, stdio=False)
        try:
            code = await asyncio.wait_for(proc.process.wait(), timeout_s)
        except asyncio.TimeoutError:
            code = -9
        tail = proc.stderr_tail()
        await proc.close(remove_dir=False)
        try:
            proc.stderr_path.unlink()
        except OSError:
            pass
        return code, tail
