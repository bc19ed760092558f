"""Which of the trainer's Python files a sandboxed command imports from outside the interpreter's
own install trees: the modules and packages it needs from PYTHONPATH directories, `.pth`-added
paths and editable installs, found by reading its code (`ast`, nothing runs).

The sandbox's view (view.py) shows the interpreter's trees (its prefixes: the standard library
and the venv's site-packages) whole, but never a whole directory that merely sits on the
trainer's `sys.path` or PYTHONPATH: such a directory may be HOME (a trainer started as
`python -m ...` from HOME has it as `sys.path[0]`) or a project directory holding private
files (issue 46 item 11). From those only what the command imports is shown: a module's file, a
package's directory.

The search follows the command's own imports, then the imports of every module found this way
(transitively), as the child's interpreter would resolve them: the script's directory, the
PYTHONPATH entries, then the trainer's other `sys.path` entries (not the trainer's own
`sys.path[0]`, its script's or working directory, which the child does not have), then the
meta-path finders editable installs register. A module reached only by a name built at run
time (`importlib.import_module(f"...")`) is not found: put it under a package the code imports.
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
import sys
from pathlib import Path

from actionopd_jax import pyast

MAX_FILES = 5000  # source files read per command at most (a huge PYTHONPATH package stops the walk)


def interpreter_roots() -> list[str]:
    """The interpreter's install trees: its prefixes (venv and base) and the real location of
    its executable."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             str(Path(os.path.realpath(sys.executable)).parent)}
    return sorted({os.path.realpath(r) for r in roots if r})


def _under(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)


def imported_names(source: str) -> set[str]:
    """Top-level names of every absolute import in `source` (any nesting: imports inside
    functions and try blocks count)."""
    try:
        tree = pyast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    return tree_imports(tree)


def tree_imports(tree: ast.AST) -> set[str]:
    """imported_names of a parsed module (AWM's server-mode check reads the same names)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _command_sources(argv: list[str]) -> tuple[list[str], set[str], str | None]:
    """(source texts, module names run with -m, the script's directory) of a `python ...` argv."""
    sources, names, script_dir = [], set(), None
    args = argv[1:]
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-c" and i + 1 < len(args):
            sources.append(args[i + 1])
            break  # the rest are the code's own arguments
        if a == "-m" and i + 1 < len(args):
            names.add(args[i + 1].split(".")[0])
            break
        if a in ("-W", "-X"):  # options whose value is the next argument
            i += 2
            continue
        if not a.startswith("-"):
            if a.endswith(".py") and os.path.isfile(a):
                script_dir = script_dir or os.path.dirname(os.path.abspath(a))
            # the script and any Python file among its arguments (the AWM host's scenario code)
            for b in args[i:]:
                if b.endswith(".py") and os.path.isfile(b):
                    try:
                        sources.append(Path(b).read_text(encoding="utf-8", errors="replace"))
                    except OSError:
                        pass
            break
        i += 1
    return sources, names, script_dir


def _search_path(script_dir: str | None) -> list[str]:
    """The directories the child's interpreter searches, in its order (existing ones)."""
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = list(sys.path[1:])
    if sys.path and sys.path[0] and sys.path[0] in pythonpath:
        rest.insert(0, sys.path[0])
    out = ([script_dir] if script_dir else []) + pythonpath + rest
    seen, kept = set(), []
    for p in out:
        p = os.path.abspath(p)
        if p not in seen and os.path.isdir(p):
            seen.add(p)
            kept.append(p)
    return kept


def _find(name: str, path: list[str]):
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None:
        return spec
    for finder in sys.meta_path:  # editable installs' finders (after the path-based search)
        if finder is importlib.machinery.PathFinder or finder in (importlib.machinery.BuiltinImporter,
                                                                   importlib.machinery.FrozenImporter):
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, None)
        except Exception:  # noqa: BLE001 - a third-party finder's failure means "not found here"
            continue
        if spec is not None:
            return spec
    return None


def _spec_paths(spec) -> list[str]:
    """The files / directories that make up a found module: a package's directories, else its file."""
    if spec.submodule_search_locations:
        return [os.path.abspath(p) for p in spec.submodule_search_locations if os.path.isdir(p)]
    origin = spec.origin
    return [os.path.abspath(origin)] if origin and os.path.isfile(origin) else []


def _py_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path] if path.endswith(".py") else []
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return out


def outside_imports(argv: list[str], skip_roots: list[str]) -> list[str]:
    """The module files and package directories a `python` command imports from outside the
    interpreter's trees, its script's directory and `skip_roots` (what the view already shows),
    with their own imports followed transitively. [] for a command that is not a Python
    interpreter."""
    if not argv or not os.path.basename(argv[0]).startswith("python"):
        return []
    sources, names, script_dir = _command_sources(argv)
    for src in sources:
        names |= imported_names(src)
    path = _search_path(script_dir)
    skip = [os.path.realpath(r) for r in [*interpreter_roots(), *skip_roots]] + \
        ([os.path.realpath(script_dir)] if script_dir else [])
    found: list[str] = []
    done: set[str] = set()
    read = 0
    todo = sorted(names)
    while todo:
        name = todo.pop()
        if name in done or name in sys.builtin_module_names:
            continue
        done.add(name)
        try:
            spec = _find(name, path)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        for p in _spec_paths(spec):
            if _under(p, skip) or p in found:
                continue
            found.append(p)
            for f in _py_files(p):
                read += 1
                if read > MAX_FILES:
                    return found
                try:
                    text = Path(f).read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue
                todo += sorted(imported_names(text) - done)
    return found
