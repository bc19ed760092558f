"""The child half of the sandbox: run as `python -I -S launcher.py SPEC_JSON -- ARGV...`, it
contains itself and then exec()s the server, so the server inherits every limit and keeps the
launcher's pid.

Stdlib only and imported by nothing: it runs in a fresh interpreter (no site-packages, no
threads), where setsid / setrlimit / prctl are safe, unlike a preexec_fn in a threaded trainer.
SPEC_JSON keys (all written by sandbox.py): parent (the trainer's pid, to catch a parent that
died before the death signal was armed), cwd, env (the complete environment), rlimits
({name: soft=hard}), netns (bool: try a private network namespace with only loopback).
Exit codes before the exec: 120 bad spec, 121 the parent is already gone, 122 the exec failed.
"""

import ctypes
import fcntl
import json
import os
import resource
import select
import signal
import socket
import struct
import sys

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x20000000, 0x10000000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1  # x86_64 and arm64: 442
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def _loopback_up() -> None:
    # a new network namespace starts with lo down; servers may still want 127.0.0.1 internally
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _read_only_except(libc, workdir: str) -> None:
    # every mount read-only (recursively), then the private working directory writable again
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    wd = workdir.encode()
    if libc.mount(wd, wd, None, MS_BIND | MS_REC, None) != 0:
        raise OSError(ctypes.get_errno(), "bind mount of the working directory")
    for path, attr in ((b"/", _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)), (wd, _MountAttr(0, MOUNT_ATTR_RDONLY, 0, 0))):
        if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path, AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)) != 0:
            raise OSError(ctypes.get_errno(), "mount_setattr")


def _namespaces(libc, spec: dict) -> dict[str, str]:
    """Private user + pid + mount + network namespaces, each where the kernel allows it."""
    got = {"userns": "off", "pidns": "off", "mountns": "off", "netns": "off"}
    wanted = set(spec.get("namespaces", ()))
    if not wanted:
        return got
    if libc.unshare(CLONE_NEWUSER) != 0:
        got["userns"] = f"unavailable(errno {ctypes.get_errno()})"
        return got
    got["userns"] = "on"
    for key, flag in (("pidns", CLONE_NEWPID), ("mountns", CLONE_NEWNS), ("netns", CLONE_NEWNET)):
        if key not in wanted:
            continue
        got[key] = "on" if libc.unshare(flag) == 0 else f"unavailable(errno {ctypes.get_errno()})"
    if got["mountns"] == "on":
        try:
            _read_only_except(libc, spec["cwd"])
            got["mountns"] = "on(read-only except cwd)"
        except OSError as err:
            got["mountns"] = f"on(no read-only view: {err})"
    if got["netns"] == "on":
        try:
            _loopback_up()
            got["netns"] = "on(loopback only)"
        except OSError:
            got["netns"] = "on(no interface up)"
    return got


def _wait_and_exit(child: int) -> None:
    # the launcher stays as the pid namespace's parent: it exits with the server's status, and
    # its own death (death signal from the trainer) takes the namespace's init, hence every
    # process in it, down with it
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


def main(argv: list[str]) -> None:
    try:
        spec = json.loads(argv[1])
        sep = argv.index("--")
        target = argv[sep + 1:]
        if not target:
            raise ValueError("no command")
    except (IndexError, ValueError) as err:
        sys.stderr.write(f"sandbox launcher: bad arguments: {err}\n")
        os._exit(120)
    libc = ctypes.CDLL(None, use_errno=True)
    # own session and process group: the trainer kills the whole group on close
    try:
        os.setsid()
    except OSError:
        pass  # already a group leader (start_new_session did it)
    # die with the trainer, even after kill -9 of it; armed, then the race re-checked
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(spec["parent"]):
        os._exit(121)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid escalation from here on
    got = _namespaces(libc, spec)
    if got["pidns"] == "on":
        # the parent is outside the new pid namespace (getppid() reads 0 there), so a pipe
        # tells the child whether the launcher died before its own death signal was armed
        alive_r, alive_w = os.pipe()
        child = os.fork()  # the first child of unshare(CLONE_NEWPID) is the namespace's init
        if child:
            os.close(alive_r)
            _wait_and_exit(child)
        os.close(alive_w)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if select.select([alive_r], [], [], 0)[0]:  # EOF: the launcher is gone
            os._exit(121)
        os.close(alive_r)
    for name, value in spec.get("rlimits", {}).items():
        try:
            resource.setrlimit(getattr(resource, name), (int(value), int(value)))
        except (ValueError, OSError) as err:
            sys.stderr.write(f"sandbox launcher: {name}={value} not applied: {err}\n")
    os.umask(0o077)
    os.chdir(spec["cwd"])
    env = dict(spec["env"])
    # what was actually enforced, for the server's own logs and for tests
    env["ACTIONOPD_SANDBOX"] = ",".join(f"{k}={v}" for k, v in got.items())
    # signals the trainer may have ignored or blocked must not be inherited as such
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGXCPU):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    try:
        os.execvpe(target[0], target, env)
    except OSError as err:
        sys.stderr.write(f"sandbox launcher: cannot run {target[0]!r}: {err}\n")
        os._exit(122)


if __name__ == "__main__":
    main(sys.argv)
