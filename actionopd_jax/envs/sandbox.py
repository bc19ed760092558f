"""What the data side of the AWM / EnvScaler pools needs from a sandbox for untrusted,
machine-generated code (verifiers, check functions, environment classes), and a minimal
subprocess runner that meets it for tests and audits.

Nothing here execs dataset code in the trainer's process. Two contracts:

- `Sandbox.run_function(code, entry, kwargs, *, globals_, timeout_s)`: in a fresh process, run
  `code` as a module whose namespace first holds `globals_` (JSON values), then call the
  function named `entry` with those of `kwargs` its signature accepts by name (all of them if it
  takes **kwargs; positionally in order if it names none of them) and return its JSON-encoded
  result. The code sees none of the host's files but the system's, the interpreter's and
  `read_paths` (read-only): files named in kwargs must lie there (the DB files a verifier compares).
- `Sandbox.open_class(code, class_name, init_config, *, timeout_s)` -> `ClassSession`: a live
  instance of an environment class (EnvScaler) in its own process: `call(method, arguments)`
  returns the method's result rendered with `str()` (what the published harness shows the
  agent), `state()` the instance's public attributes as JSON, `close()` ends the process.

`SubprocessSandbox` runs each call or session as a child started through the MCP servers'
launcher (`envs/mcp/sandbox.py`, whose table says what is enforced): its own session and
process group, a scrubbed environment, a private working directory, private namespaces and a
root that shows only the system's files, the interpreter and `read_paths` (no HOME), rlimits (an 8 MiB cap on each file the code writes, its prints included;
CPU seconds for one-shot calls only: a class session has no CPU-time limit, it lives one
episode), plus here a wall-clock limit per call and an 8 MiB cap on a session's reply line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from actionopd_jax.envs.scratch import scratch_dir


@dataclass(frozen=True)
class SandboxResult:
    ok: bool  # the function ran and returned a JSON-encodable value
    value: Any = None
    error: str = ""  # why not ok: "timeout after Ns", "exit N: <stderr tail>", "<ExcType>: msg"
    wall_s: float = 0.0
    stderr_tail: str = ""


class SandboxError(RuntimeError):
    """A class session failed. `fatal`: its process died, timed out or answered garbage (the
    session is closed); not fatal: the method raised inside a live instance (the session goes on)."""

    def __init__(self, message: str, *, fatal: bool = True):
        super().__init__(message)
        self.fatal = fatal


@runtime_checkable
class ClassSession(Protocol):
    def call(self, method: str, arguments: dict[str, Any]) -> str: ...

    def state(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class Sandbox(Protocol):
    def run_function(self, code: str, entry: str, kwargs: dict[str, Any], *,
                     globals_: dict[str, Any] | None = None, timeout_s: float = 30.0,
                     read_paths: tuple[str, ...] = ()) -> SandboxResult: ...

    def open_class(self, code: str, class_name: str, init_config: dict[str, Any], *,
                   timeout_s: float = 30.0) -> ClassSession: ...


# The child's program: read one JSON request on stdin, answer on stdout (one JSON line per reply).
_CHILD = r'''
import inspect, json, sys, types, copy
def _call(fn, kwargs):
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(**kwargs)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    named = {k: v for k, v in kwargs.items() if k in params}
    if named or not kwargs:
        return fn(**named)
    return fn(*list(kwargs.values())[:len(params)])
def _reply(obj):
    sys.__stdout__.write(json.dumps(obj, default=str) + "\n"); sys.__stdout__.flush()
def _public(inst):
    return {k: v for k, v in vars(inst).items() if not (k.startswith("__") and k.endswith("__"))}
req = json.loads(sys.stdin.readline())
sys.stdout = sys.stderr  # the code's own prints never corrupt the reply channel
mod = types.ModuleType("sandboxed")
mod.__dict__.update(req.get("globals") or {})
try:
    exec(compile(req["code"], "<dataset code>", "exec"), mod.__dict__)
    if req["kind"] == "function":
        fn = mod.__dict__.get(req["entry"])
        if not callable(fn):
            raise NameError("function %r not found in the code" % req["entry"])
        _reply({"ok": True, "value": _call(fn, req["kwargs"])})
        sys.exit(0)
    cls = mod.__dict__.get(req["entry"])
    if not isinstance(cls, type):
        raise NameError("class %r not found in the code" % req["entry"])
    cfg = copy.deepcopy(req["kwargs"])
    try:
        inst = cls(copy.deepcopy(cfg))
    except TypeError:
        inst = cls()
    for k, v in cfg.items():
        setattr(inst, k, v)
    _reply({"ok": True, "value": None})
except SystemExit:
    raise
except BaseException as e:
    _reply({"ok": False, "error": "%s: %s" % (type(e).__name__, e)})
    sys.exit(0)
for line in sys.stdin:
    msg = json.loads(line)
    try:
        if msg["op"] == "state":
            _reply({"ok": True, "value": _public(inst)})
        elif msg["op"] == "state_is_json":
            s = _public(inst)
            _reply({"ok": True, "value": json.loads(json.dumps(s)) == s})
        elif msg["op"] == "call":
            name = msg["method"]
            if name.startswith("_") or not callable(getattr(inst, name, None)):
                raise AttributeError("no tool %r" % name)
            _reply({"ok": True, "value": str(getattr(inst, name)(**msg["arguments"]))})
        else:
            break
    except BaseException as e:
        _reply({"ok": False, "error": "%s: %s" % (type(e).__name__, e)})
'''

MAX_OUTPUT_BYTES = 8 << 20  # file-size limit in the child: its stderr file (and any file it writes)
MAX_REPLY_BYTES = 8 << 20  # one reply line of a class session (a pipe: no rlimit bounds it)


def _contained_argv(python: str, workdir: str, cpu_s: float | None,
                    read_paths: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    """The child's command through the MCP servers' launcher (envs/mcp/sandbox.py), so dataset
    code gets the same containment as a server: scrubbed environment, private pid / mount /
    network namespaces (a new root: the system's files, the interpreter and `read_paths`
    read-only, its directory writable; loopback only), rlimits (CPU seconds for one-shot calls, memory, file size, open files), no
    new privileges, and a parent-death signal."""
    from actionopd_jax.envs.mcp.sandbox import Limits, Sandbox

    limits = Limits(cpu_s=0 if cpu_s is None else int(cpu_s) + 2, file_mb=MAX_OUTPUT_BYTES >> 20)
    return Sandbox(limits, read_only=read_paths).launcher_argv([python, "-I", "-c", _CHILD], Path(workdir),
                                                               network=False)


def _tail(workdir: str, n: int = 2000) -> str:
    try:
        with open(os.path.join(workdir, "stderr.txt"), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class SubprocessSandbox:
    """One `python -c` child per function call or class session, in its own process group."""

    def __init__(self, python: str = sys.executable):
        self.python = python

    def _spawn(self, workdir: str, cpu_s: float | None = None, read_paths: tuple[str, ...] = ()) -> subprocess.Popen:
        # the code's output (its prints go to stderr) lands in a capped file, never in our memory
        err = open(os.path.join(workdir, "stderr.txt"), "w")
        try:
            argv, env = _contained_argv(self.python, workdir, cpu_s, tuple(read_paths))
            return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=workdir,
                                    env=env, text=True, start_new_session=True, close_fds=True)
        finally:
            err.close()

    def run_function(self, code: str, entry: str, kwargs: dict[str, Any], *,
                     globals_: dict[str, Any] | None = None, timeout_s: float = 30.0,
                     read_paths: tuple[str, ...] = ()) -> SandboxResult:
        t0 = time.monotonic()
        request = json.dumps({"kind": "function", "code": code, "entry": entry, "kwargs": kwargs,
                              "globals": globals_ or {}}) + "\n"
        with tempfile.TemporaryDirectory(prefix="sandbox-", dir=scratch_dir()) as workdir:
            proc = self._spawn(workdir, cpu_s=timeout_s, read_paths=read_paths)
            try:
                out, _ = proc.communicate(request, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return SandboxResult(False, error=f"timeout after {timeout_s:g}s", wall_s=time.monotonic() - t0,
                                     stderr_tail=_tail(workdir))
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
            err = _tail(workdir)
        wall = time.monotonic() - t0
        lines = [ln for ln in out.splitlines() if ln.strip()]
        if not lines:
            return SandboxResult(False, error=f"exit {proc.returncode}: no reply", wall_s=wall, stderr_tail=err)
        try:
            reply = json.loads(lines[-1])
        except json.JSONDecodeError:
            return SandboxResult(False, error="malformed reply", wall_s=wall, stderr_tail=err)
        if not reply.get("ok"):
            return SandboxResult(False, error=reply.get("error", "failed"), wall_s=wall, stderr_tail=err)
        return SandboxResult(True, value=reply.get("value"), wall_s=wall, stderr_tail=err)

    def open_class(self, code: str, class_name: str, init_config: dict[str, Any], *,
                   timeout_s: float = 30.0, workdir_parent: str | None = None) -> "_SubprocessSession":
        """`workdir_parent`: where the session's private directory is made (default: this
        process's scratch directory, envs/scratch.py; the matcher's forks put theirs in
        envs/fork.py's). Either is swept by a later process after a `kill -9`."""
        return _SubprocessSession(self, code, class_name, init_config, timeout_s, workdir_parent)


@dataclass
class _SubprocessSession:
    sandbox: SubprocessSandbox
    code: str
    class_name: str
    init_config: dict[str, Any]
    timeout_s: float
    workdir_parent: str | None = None
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _dir: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)
    _unread: bytes = field(default=b"", init=False, repr=False)  # bytes after the last reply line

    def __post_init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="sandbox-", dir=self.workdir_parent or scratch_dir())
        self._proc = self.sandbox._spawn(self._dir.name)
        try:
            self._ask({"kind": "class", "code": self.code, "entry": self.class_name, "kwargs": self.init_config})
        except BaseException:
            self.close()  # the child exits after a failed start: reap it and its directory
            raise

    def _ask(self, msg: dict[str, Any]) -> Any:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise SandboxError("the environment process is not running")
        try:
            proc.stdin.write(json.dumps(msg) + "\n")
            proc.stdin.flush()
        except OSError:
            self.close()
            raise SandboxError("the environment process died") from None
        line = self._reply_line(proc)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            self.close()
            raise SandboxError("malformed reply from the environment process") from None
        if not reply.get("ok"):
            # the class session's child answers a method's exception and keeps serving
            raise SandboxError(reply.get("error", "failed"), fatal=msg.get("kind") == "class")
        return reply.get("value")

    def _reply_line(self, proc: subprocess.Popen) -> bytes:
        """The next reply line, read from the pipe's descriptor within the call's wall clock
        (a partial line then silence is a timeout, not a hang) and at most MAX_REPLY_BYTES
        (the file-size rlimit does not bound a pipe)."""
        import select

        fd, buf = proc.stdout.fileno(), bytearray(self._unread)
        deadline = time.monotonic() + self.timeout_s
        end = buf.find(b"\n")
        while end < 0:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise SandboxError(f"timeout after {self.timeout_s:g}s")
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.close()
                raise SandboxError("the environment process died")
            buf += chunk
            if len(buf) > MAX_REPLY_BYTES:
                self.close()
                raise SandboxError(f"malformed reply from the environment process: over {MAX_REPLY_BYTES >> 20} MiB")
            end = buf.find(b"\n", len(buf) - len(chunk))
        self._unread = bytes(buf[end + 1:])
        return bytes(buf[:end])

    def call(self, method: str, arguments: dict[str, Any]) -> str:
        return self._ask({"op": "call", "method": method, "arguments": arguments})

    def state(self) -> dict[str, Any]:
        return self._ask({"op": "state"})

    def state_is_json(self) -> bool:
        """Whether `state()` is the whole public state exactly: it survives a strict JSON round
        trip (no set, tuple, datetime or non-string key that `state()` would turn into something
        else). A fork of the episode (envs/envscaler/fork.py) is faithful only then."""
        return self._ask({"op": "state_is_json"}) is True

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                _kill_group(self._proc)
            for stream in (self._proc.stdin, self._proc.stdout):
                try:
                    stream.close()
                except Exception:
                    pass
            self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
