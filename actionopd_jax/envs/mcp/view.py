"""What a sandboxed process may see of the host's filesystem: the list of paths the launcher
(launcher.py) binds, read-only, into an otherwise empty root.

Everything else is absent from the sandbox's view, not merely read-only: the trainer's HOME,
other users' files, a 0600 file of the trainer's anywhere (a namespaced process keeps the
trainer's uid for permission checks, so "read-only" alone would still let it read them; a
tester showed exactly that, issue 34). The view is the union of:

- system files: the system's program and library trees, and the few /etc files an interpreter,
  the dynamic loader, name resolution and TLS read (not all of /etc: /etc/shadow, /etc/ssl/private
  and the like stay out);
- the Python that runs the command: its prefixes (standard library, the venv's site-packages)
  and the directory holding this package (the AWM host and the verifier child are run from it);
  never a whole directory merely because it is on the trainer's `sys.path` or PYTHONPATH (that
  may be HOME, for a trainer started as `python -m ...` from there, or a directory holding
  private files: issue 46 item 11);
- the modules the command imports from such directories, each alone: a module's file, a
  package's directory (imports.py reads the code to find them);
- the command's own code: each absolute path among its arguments (a file's directory, so a
  script's sibling modules come along) and the program the command names;
- whatever the caller adds (`extra`): an environment's code and data directories.

The launcher adds the writable private directory, a private /tmp, a minimal /dev and a /proc of
the sandbox's own pid namespace.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from actionopd_jax.envs.mcp.imports import interpreter_roots, outside_imports

# Program and library trees (on merged-/usr systems most of these are symlinks into /usr: the
# launcher recreates a symlink as a symlink).
SYSTEM_TREES: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The /etc entries a process needs to load libraries, resolve names (localhost included), look
# up users, read the time zone and verify TLS certificates.
SYSTEM_ETC: tuple[str, ...] = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "nsswitch.conf", "hosts",
    "host.conf", "resolv.conf", "gai.conf", "localtime", "timezone", "protocols", "services",
    "mime.types", "os-release", "alternatives", "ca-certificates", "ca-certificates.conf",
    "ssl/certs", "ssl/openssl.cnf", "locale.alias", "fonts", "python3", f"python3.{sys.version_info[1]}",
)
PACKAGE_DIR = Path(__file__).resolve().parents[2]  # actionopd_jax/ itself (not the checkout around it)


def _exists(path: str) -> bool:
    return os.path.lexists(path)


def python_paths() -> list[str]:
    """The running interpreter's trees (its prefixes, the real location of its executable) and
    this package's directory; the trainer's other `sys.path` / PYTHONPATH directories are not
    among them (imports.outside_imports picks what a command needs from those)."""
    return interpreter_roots() + [str(PACKAGE_DIR)]


def command_paths(argv: list[str]) -> list[str]:
    """The command's own files: the program it runs (found on PATH when not a path) and every
    absolute path among its arguments (a file's directory; "{...}" placeholders are skipped)."""
    out = []
    if argv:
        program = argv[0] if os.sep in argv[0] else shutil.which(argv[0])
        if program:
            out += [os.path.dirname(os.path.abspath(program)),
                    os.path.dirname(os.path.realpath(program))]
    for arg in argv[1:]:
        for piece in arg.split("="):  # "--config=/path/x.json" names a path too
            if piece.startswith(os.sep) and _exists(piece):
                out.append(piece if os.path.isdir(piece) else os.path.dirname(piece))
    return out


def read_only_paths(argv: list[str], extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """Every host path the sandbox binds read-only, absolute and real (symlinks resolved, so
    the launcher binds what a path leads to), existing, deduplicated and with any path under
    another one of the list left out (the outer bind already shows it). System symlinks such
    as /bin -> usr/bin are kept as they are (the launcher recreates them)."""
    wanted = [p for p in SYSTEM_TREES if _exists(p)]
    wanted += [f"/etc/{name}" for name in SYSTEM_ETC if _exists(f"/etc/{name}")]
    shown = python_paths() + [p for p in SYSTEM_TREES if _exists(p)] + [str(p) for p in extra]
    for path in python_paths() + command_paths(argv) + outside_imports(argv, shown) + [str(p) for p in extra]:
        path = os.path.abspath(path)
        if not _exists(path):
            continue
        wanted.append(path)
        real = os.path.realpath(path)
        if real != path:
            wanted.append(real)
    # never the whole root, the sandbox's own /tmp, or the kernel's trees (the launcher makes
    # its own /dev and /proc): an argument like "--log=/dev/stderr" must not expose them
    unique = sorted(p for p in set(wanted) if p not in ("/", "/tmp")
                    and not any(p == k or p.startswith(k + "/") for k in ("/dev", "/proc", "/sys")))
    kept: list[str] = []
    for path in unique:  # sorted: an ancestor comes before its descendants
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept
