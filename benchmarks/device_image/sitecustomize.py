"""Make this interpreter look like the H200 host's image: every installed distribution that is
not in that image's package list is hidden, its modules and its metadata, and the editable
install of actionopd_jax is dropped, so the package comes from PYTHONPATH as it does there.

Active only when ACTIONOPD_DEVICE_IMAGE names a package list (h200_packages.txt), with this
folder on PYTHONPATH; child interpreters inherit both, so the device check's measuring
processes are held to the same image. Used by tests/test_device_check.py: the device check
must run there with nothing installed, and this is how CI proves it on a CPU host. jax itself
stays this host's version (the image's 0.11 cannot be installed here).
"""

import importlib.machinery
import importlib.metadata
import os
import re
import sys

_LIST = os.environ.get("ACTIONOPD_DEVICE_IMAGE")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name or "").lower()


def _module_roots(dist) -> set[str]:
    """Top-level module names a distribution installs, from its RECORD."""
    roots = set()
    for f in dist.files or ():
        parts = f.parts
        if not parts or parts[0] == ".." or parts[0].endswith((".dist-info", ".data", ".pth")):
            continue
        if len(parts) == 1:
            if not f.name.endswith((".py", ".so", ".pyd")):
                continue
            roots.add(f.name.split(".", 1)[0])
        else:
            roots.add(parts[0])
            roots.add(parts[0] + "/" + parts[1].split(".", 1)[0])  # second level, for namespace packages
    return roots


def _with_requirements(listed: set[str]) -> set[str]:
    """The listed distributions and, transitively, what they require here (not their extras):
    the image's versions hold their own requirements, which may be other distributions than
    this host's versions need (huggingface_hub here requires httpx2, there not)."""
    by_name = {_norm(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    allowed, todo = set(listed), [n for n in listed if n in by_name]
    while todo:
        for req in by_name[todo.pop()].requires or ():
            name, _, marker = req.partition(";")
            if "extra" in marker:
                continue
            dep = _norm(re.split(r"[\s<>=!~\[(]", name.strip(), maxsplit=1)[0])
            if dep not in allowed:
                allowed.add(dep)
                if dep in by_name:
                    todo.append(dep)
    return allowed


def _blocked_roots(allowed: set[str]) -> list[str]:
    """Dotted module prefixes of the hidden distributions. A top-level name that an allowed
    distribution also uses (a namespace such as `google`) is hidden one level down only."""
    owners: dict[str, set[bool]] = {}
    hidden = []
    for dist in importlib.metadata.distributions():
        keep = _norm(dist.metadata["Name"]) in allowed
        roots = _module_roots(dist)
        for r in roots:
            owners.setdefault(r, set()).add(keep)
        if not keep:
            hidden.append(roots)
    out = set()
    for roots in hidden:
        for r in roots:
            if "/" in r:
                top = r.split("/")[0]
                if True in owners.get(top, ()) and owners[r] == {False}:
                    out.add(r.replace("/", "."))
            elif owners.get(r) == {False} and not r.startswith("__editable__"):
                out.add(r)
    out.discard("actionopd_jax")  # comes from PYTHONPATH, as on the device
    return sorted(out)


class _HideFinder:
    """Wraps the path finder: hidden modules are not found, hidden distributions not listed."""

    def __init__(self, inner, blocked: list[str], allowed: set[str]):
        self.inner, self.blocked, self.allowed = inner, tuple(blocked), allowed

    def _hidden(self, name: str) -> bool:
        return any(name == b or name.startswith(b + ".") for b in self.blocked)

    def find_spec(self, name, path=None, target=None):
        return None if self._hidden(name) else self.inner.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        for d in self.inner.find_distributions(*args, **kwargs):
            if _norm(d.metadata["Name"]) in self.allowed:
                yield d

    def invalidate_caches(self):
        self.inner.invalidate_caches()


def _install(list_path: str) -> None:
    with open(list_path) as fh:
        lines = [line.strip() for line in fh if line.strip() and not line.startswith("#")]
    # "-name": known absent there, even where this host's version of a listed package requires it
    absent = {_norm(n[1:]) for n in lines if n.startswith("-")}
    allowed = _with_requirements({_norm(n) for n in lines if not n.startswith("-")}) - absent
    cached = os.environ.get("ACTIONOPD_DEVICE_HIDDEN")
    blocked = cached.split(",") if cached else _blocked_roots(allowed)
    os.environ["ACTIONOPD_DEVICE_HIDDEN"] = ",".join(blocked)  # children skip the scan
    sys.meta_path[:] = [
        _HideFinder(f, blocked, allowed) if f is importlib.machinery.PathFinder else f
        for f in sys.meta_path if "editable" not in type(f).__name__.lower()
        and "editable" not in getattr(f, "__name__", "").lower()]


if _LIST:
    _install(_LIST)
