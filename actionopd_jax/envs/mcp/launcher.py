"""The child half of the sandbox: run as `python -I -S launcher.py SPEC_JSON -- ARGV...`, it
contains itself and then exec()s the server, so the server inherits every limit and keeps the
launcher's pid.

Stdlib only and imported by nothing: it runs in a fresh interpreter (no site-packages, no
threads), where setsid / setrlimit / prctl are safe, unlike a preexec_fn in a threaded trainer.
SPEC_JSON keys (all written by sandbox.py): parent (the trainer's pid, to catch a parent that
died before the death signal was armed), cwd, env (the complete environment), rlimits
({name: soft=hard}), namespaces (which private namespaces: "pidns", "mountns", "netns"; a user
namespace comes with any), inner_id (the uid/gid the trainer's ids map to inside), view
({"read_only": [host paths], "writable": [host paths], "tmp_mb": N}: the new root, view.py).
With a pid namespace the processes are: the launcher (outside, exits with the server's status),
the namespace's init (pid 1: builds the root, then reaps orphans) and the server (pid 2).
Exit codes before the exec: 120 bad spec, 121 the parent is already gone, 122 the exec failed,
123 the containment asked for could not be set up (fails closed, with a paragraph on stderr).
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
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 1 << 18
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000  # x86_64 and arm64: 442
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MNT_DETACH = 0x1, 0x2, 0x2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
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


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise OSError(ctypes.get_errno(), what)


def _mount(libc, src, dst: str, fstype, flags: int, data=None) -> None:
    enc = (lambda v: None if v is None else v.encode())
    _check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) == 0, f"mount {dst}")


def _set_attr(libc, path: str, attr_set: int, *, recursive: bool = True) -> None:
    attr = _MountAttr(attr_set, 0, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    _check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr),
                        ctypes.sizeof(attr)) == 0, f"mount_setattr {path}")


def _pivot(libc, new_root: str, put_old: str) -> None:
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    _check(number is not None, f"pivot_root: unknown syscall number on {os.uname().machine}")
    _check(libc.syscall(number, new_root.encode(), put_old.encode()) == 0, "pivot_root")


def _map_ids(spec: dict, uid: int, gid: int) -> None:
    # Map the trainer's uid/gid to an unprivileged id inside: files the sandbox creates on its
    # own tmpfs need a mapped owner, and a non-zero id inside loses every capability at exec.
    inner = int(spec.get("inner_id", 1000))
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{inner} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{inner} {gid} 1")


def _place(src: str, dst: str) -> None:
    # the mount point for `src` at `dst`: parents as directories, then a directory or a file
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.lexists(dst):
        return
    if os.path.isdir(src):
        os.mkdir(dst)
    else:
        open(dst, "w").close()


def _bind(libc, src: str, dst: str, *, read_only: bool) -> None:
    if os.path.islink(src) and not os.path.lexists(dst):
        # a system symlink (/bin -> usr/bin) stays a symlink into the new root
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.symlink(os.readlink(src), dst)
        return
    _place(src, dst)
    _mount(libc, src, dst, None, MS_BIND | MS_REC)
    _set_attr(libc, dst, (MOUNT_ATTR_RDONLY if read_only else 0) | MOUNT_ATTR_NOSUID)


def _minimal_dev(libc, dev: str) -> None:
    os.makedirs(dev, exist_ok=True)
    _mount(libc, "tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in ("null", "zero", "full", "random", "urandom", "tty"):
        if os.path.exists(f"/oldroot/dev/{name}"):
            open(f"{dev}/{name}", "w").close()
            _mount(libc, f"/oldroot/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm")  # POSIX semaphores and shared memory (multiprocessing) live here
    _mount(libc, "tmpfs", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m")


def _private_root(libc, spec: dict, *, with_proc: bool) -> None:
    """Replace the filesystem by a new root holding only the view (view.py's paths, read-only),
    the writable working directory, a private /tmp, a minimal /dev and (in a private pid
    namespace) a /proc of its own. Everything else of the host, HOME included, is gone."""
    view = spec["view"]
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    # a scratch root on /tmp: pivot into it, so the host's tree is reachable under /oldroot
    # while the new root is built beside it, then detached as a whole
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700")
    os.chdir("/tmp")
    os.mkdir("newroot")
    os.mkdir("oldroot")
    _pivot(libc, ".", "oldroot")
    os.chdir("/")
    new = "/newroot"
    _mount(libc, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")  # a mount: pivot needs one
    os.makedirs(f"{new}/tmp")
    _mount(libc, "tmpfs", f"{new}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={int(view['tmp_mb'])}m")
    for path in view["read_only"]:
        _bind(libc, "/oldroot" + path, new + path, read_only=True)
    for path in view["writable"]:
        _bind(libc, "/oldroot" + path, new + path, read_only=False)
    _minimal_dev(libc, f"{new}/dev")
    if with_proc:
        # mounted while the host's /proc is still attached (the kernel allows a new proc in a
        # user namespace only where one is fully visible), in this pid namespace: it lists
        # the sandbox's own processes only
        os.makedirs(f"{new}/proc", exist_ok=True)
        _mount(libc, "proc", f"{new}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _set_attr(libc, new, MOUNT_ATTR_RDONLY, recursive=False)  # its skeleton only; /tmp and cwd stay writable
    os.chdir(new)
    _pivot(libc, ".", ".")  # the old (scratch) root now sits on top of the new one ...
    _check(libc.umount2(b".", MNT_DETACH) == 0, "detach the host's tree")  # ... and goes
    os.chdir("/")


def _namespaces(libc, spec: dict) -> dict[str, str]:
    """Private user + pid + mount + network namespaces, each where the kernel allows it."""
    got = {"userns": "off", "pidns": "off", "mountns": "off", "netns": "off"}
    wanted = set(spec.get("namespaces", ()))
    if not wanted:
        return got
    uid, gid = os.geteuid(), os.getegid()  # read before: inside, unmapped ids read as "nobody"
    if libc.unshare(CLONE_NEWUSER) != 0:
        got["userns"] = f"unavailable(errno {ctypes.get_errno()})"
        return got
    try:
        _map_ids(spec, uid, gid)
        got["userns"] = "on"
    except OSError as err:
        got["userns"] = f"unavailable(id map: {err})"
        return got
    for key, flag in (("pidns", CLONE_NEWPID), ("mountns", CLONE_NEWNS), ("netns", CLONE_NEWNET)):
        if key not in wanted:
            continue
        got[key] = "on" if libc.unshare(flag) == 0 else f"unavailable(errno {ctypes.get_errno()})"
    if got["netns"] == "on":
        try:
            _loopback_up()
            got["netns"] = "on(loopback only)"
        except OSError:
            got["netns"] = "on(no interface up)"
    return got


def _refuse(got: dict[str, str], wanted: set[str], detail: str = "") -> None:
    # fail closed: dataset code never runs with less containment than was asked for
    missing = ", ".join(f"{k}: {v}" for k, v in got.items() if (k in wanted or k == "userns") and
                        not v.startswith("on"))
    sys.stderr.write(
        "sandbox launcher: cannot contain this command, so it does not run. The kernel refused what the "
        f"sandbox needs ({missing or detail}). Environment code runs only inside private user, pid, mount "
        "(and, for servers that need no port, network) namespaces; allow unprivileged user namespaces on "
        "this machine (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone = 1, and on "
        "Ubuntu kernel.apparmor_restrict_unprivileged_userns = 0), or run on one that does.\n")
    os._exit(123)


def _exit_like(status: int) -> None:
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


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
    _exit_like(status)


def _reap_until(server: int) -> None:
    # the namespace's init: every orphan (a tool's double-forked daemon) is re-parented here
    # and reaped, so a process the trainer kills at a reset is gone, not a zombie; when the
    # server exits, init exits with its status and the kernel ends whatever is left
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(0)
        if pid == server:
            _exit_like(status)


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
    wanted = set(spec.get("namespaces", ()))
    if wanted and any(not got[k].startswith("on") for k in wanted | {"userns"}):
        _refuse(got, wanted)
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
    if got["mountns"] == "on":
        # built by the namespace's init (this process), so its /proc shows this pid namespace
        try:
            _private_root(libc, spec, with_proc=got["pidns"] == "on")
            got["mountns"] = "on(private root)"
        except OSError as err:
            _refuse(got, wanted, f"building the private root: {err}")
    if got["pidns"] == "on":
        server = os.fork()  # pid 2: the server; this process stays pid 1, the reaper
        if server:
            _reap_until(server)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
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
