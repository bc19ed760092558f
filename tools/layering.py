"""The package's import layering: which module imports which, and whether that runs downward.

    python tools/layering.py [ROOT] [--detail]

prints the edges between layer units (longest-prefix entries of LAYERS) with their layers, every
module-import cycle, every upward import and every module without a layer; exits 1 if any of
those (other than ALLOWED_UPWARD) exist. tests/test_layering.py runs the same analysis.

What counts as an import of a package module (so nothing hides behind laziness):
- `import a.b.c` and `from a.b import c` anywhere in the file: module level, in functions,
  under `if TYPE_CHECKING:` (a type-only dependency is still a dependency);
- relative imports, resolved against the importing module's package;
- `from pkg import name`: the submodule `pkg.name` if it exists, else `pkg` (its `__init__`),
  so a package `__init__` that re-exports is an edge like any other module;
- a package module's dotted name as a string (optionally `name:attr`) passed to
  `import_module` / `__import__` or held in a literal table (dict value, tuple, list): the way
  lazy `__getattr__` exports and subcommand registries name their targets.
Executing a parent package's `__init__` (implied by importing any submodule) is not counted:
otherwise every re-exporting `__init__` would form a cycle with its own submodules.

Stdlib only (no jax import): it parses the files with `ast`.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "actionopd_jax"

# Layer table (bottom -> top), as in docs/architecture.md. Keys are module names relative to the
# package; the longest matching dotted prefix decides a module's layer. A module may import
# modules of its own layer or lower ones only.
LAYERS: dict[str, int] = {
    "types": 0,
    "compile_cache": 0,
    "cuda_plugin": 0,  # which jax CUDA plugin is installed, asked without importing jax
    "jax_compat": 0,  # the jax APIs whose names moved between releases
    "config": 0,  # the package __init__: re-exports schema + errors only
    "providers": 0,  # what each OpenAI-compatible vendor can be sent, and how
    "paid_calls": 0,  # the ledger of paid calls and run.budget_* as a hard cap (every endpoint reserves on it)
    "pyast": 0,  # one lock around this process's own ast.parse / compile (CPython 3.11 races them across threads)
    "config.schema": 0,  # `Config` and the resume comparison; the sections by topic below
    "config.learner": 0,  # model / mesh / train
    "config.sources": 0,  # collect / kd / teacher / matcher
    "config.env_section": 0,
    "config.run_section": 0,  # checkpoint / run
    "config.build": 0,  # the typed tree builder (keys and types checked)
    "config.errors": 0,
    "config.experiment": 0,  # the experiment *section* dataclass
    "config.method": 0,  # the objective / group-source pairing rule
    "config.rollout": 0,  # which rollout path (engine or static) "auto" means on each platform
    "config.eval_section": 0,  # the `eval:` section: table 8's evaluation rows and B.3's limits
    "aot": 1,
    "chat": 2,
    "model": 3,  # includes model.attention and the runtime options
    "rewards": 4,
    "checkpoint": 5,
    "envs": 6,
    "envs.mcp": 6,  # any MCP server as an environment, its server code sandboxed
    "sampling": 7,
    "engine": 7,  # the continuous-batching engine, beside the static sampler it reuses
    "teacher": 8,
    "teacher.transport": 0,  # stdlib only: the one retry rule, shared by the user simulator (envs)
    "matching": 9,
    "screening": 9,  # the static feasibility screen's judge, prompt and verdict cache (B.1)
    "train": 10,  # the trainer as a library
    "collect": 11,
    "serve": 12,
    "eval": 13,
    "baselines": 14,
    "config.files": 15,  # the config front end: base: chains, cross-field checks, loading
    "config.checks": 15,
    "config.load": 15,
    "experiment": 16,
    "launch": 16,
    "testing": 16,
    "commands": 17,
}
ROOT_LAYER = 0  # actionopd_jax/__init__.py itself (exact match only)

# Upward imports that stay, at most 4, each (importer, target, reason). Names are relative to the
# package, exact module names.
ALLOWED_UPWARD: list[tuple[str, str, str]] = []
MAX_ALLOWED_UPWARD = 4


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, relative to the package ("" = the package __init__)
    target: str
    path: str  # importing file, relative to ROOT
    line: int
    kind: str  # "module level" | "in function" | "string"

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def discover(root: Path) -> dict[str, Path]:
    """Every module of the package: relative dotted name -> file."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root / PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _relative(name: str) -> str | None:
    """'actionopd_jax.x.y' -> 'x.y'; the package itself -> ''; foreign names -> None."""
    if name == PACKAGE:
        return ""
    if name.startswith(PACKAGE + "."):
        return name[len(PACKAGE) + 1 :]
    return None


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a package module (the module an import executes)."""
    while name not in modules:
        if "." not in name:
            return "" if "" in modules else None
        name = name.rpartition(".")[0]
    return name


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: dict[str, Path]):
        self.module, self.is_package, self.modules = module, is_package, modules
        self.depth = 0
        self.in_table = False
        self.found: list[tuple[str, int, str]] = []  # (target, line, kind)

    def _kind(self) -> str:
        return "in function" if self.depth else "module level"

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _add(self, absolute: str, line: int, kind: str) -> None:
        rel = _relative(absolute)
        if rel is None:
            return
        target = _known(rel, self.modules)
        if target is not None and target != self.module:
            self.found.append((target, line, kind))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno, self._kind())

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            own = [PACKAGE] + ([p for p in self.module.split(".") if p])
            base = own if self.is_package else own[:-1]
            base = base[: len(base) - (node.level - 1)]
            absolute = ".".join(base + ([node.module] if node.module else []))
        else:
            absolute = node.module or ""
        rel = _relative(absolute)
        if rel is None:
            return
        for alias in node.names:
            sub = f"{rel}.{alias.name}" if rel else alias.name
            if alias.name != "*" and sub in self.modules:
                self._add(f"{PACKAGE}.{sub}", node.lineno, self._kind())
            else:
                self._add(absolute, node.lineno, self._kind())

    def _string(self, node: ast.AST) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value.partition(":")[0]
            if _relative(name) in self.modules:
                self._add(name, node.lineno, "string")

    def visit_Call(self, node: ast.Call) -> None:
        # importlib.import_module("actionopd_jax.x") / __import__("actionopd_jax.x")
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if called in ("import_module", "__import__") and node.args:
            self._string(node.args[0])
        outer, self.in_table = self.in_table, False  # other calls' arguments are not imports
        self.generic_visit(node)
        self.in_table = outer

    def _table(self, node: ast.AST) -> None:
        # module names as values of literal tables (lazy exports, subcommand registries)
        outer, self.in_table = self.in_table, True
        self.generic_visit(node)
        self.in_table = outer

    visit_Tuple = visit_List = visit_Set = _table

    def visit_Dict(self, node: ast.Dict) -> None:
        outer, self.in_table = self.in_table, True
        for value in node.values:
            self.visit(value)
        self.in_table = outer
        for key in node.keys:
            if key is not None:
                self.visit(key)

    def visit_Constant(self, node: ast.Constant) -> None:
        if self.in_table:
            self._string(node)


def collect_edges(root: Path) -> tuple[dict[str, Path], list[Edge]]:
    root = Path(root)
    modules = discover(root)
    edges = []
    for module, path in modules.items():
        collector = _Collector(module, path.name == "__init__.py", modules)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        rel_path = str(path.relative_to(root))
        seen = set()
        for target, line, kind in collector.found:  # `from m import a, b` is one edge per line
            if (target, line) not in seen:
                seen.add((target, line))
                edges.append(Edge(module, target, rel_path, line, kind))
    return modules, edges


def unit(module: str) -> str | None:
    """The LAYERS key a module belongs to (longest dotted prefix), '' for the package root."""
    if module == "":
        return ""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return key
    return None


def layer(module: str) -> int | None:
    key = unit(module)
    if key is None:
        return None
    return ROOT_LAYER if key == "" else LAYERS[key]


def _name(module: str) -> str:
    return f"{PACKAGE}.{module}" if module else PACKAGE


def _shortest_cycle(graph: dict[str, dict[str, Edge]], start: str, members: set[str]) -> list[str] | None:
    """The shortest path start -> ... -> start inside `members` (breadth first), as its nodes."""
    parent: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        nxt = []
        for v in queue:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1]
                if w in members and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        queue = nxt
    return None


def cycles(modules: dict[str, Path], edges: list[Edge]) -> list[list[Edge]]:
    """One shortest cycle (as its edges) per strongly connected component of the module graph."""
    graph: dict[str, dict[str, Edge]] = {m: {} for m in modules}
    for e in edges:
        graph[e.source].setdefault(e.target, e)  # the first occurrence names the line
    reach: dict[str, set[str]] = {}
    for start in graph:  # a few hundred modules: plain reachability is fast enough
        seen, todo = set(), [start]
        while todo:
            for w in graph[todo.pop()]:
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        reach[start] = seen
    found, done = [], set()
    for v in sorted(graph):
        if v in done or v not in reach[v]:
            continue
        members = {w for w in reach[v] if v in reach[w]}
        done |= members
        best = min((c for c in (_shortest_cycle(graph, m, members) for m in sorted(members)) if c), key=len)
        loop = best + [best[0]]
        found.append([graph[x][y] for x, y in zip(loop, loop[1:])])
    return found


def upward(edges: list[Edge]) -> list[Edge]:
    """Imports of a higher layer than the importer's (both layered)."""
    out = []
    for e in edges:
        a, b = layer(e.source), layer(e.target)
        if a is not None and b is not None and b > a:
            out.append(e)
    return sorted(out, key=lambda e: (e.path, e.line, e.target))


def allowed(edge: Edge) -> bool:
    return any(edge.source == s and edge.target == t for s, t, _ in ALLOWED_UPWARD)


def unlayered(modules: dict[str, Path]) -> list[str]:
    return sorted(m for m in modules if layer(m) is None)


def describe(edge: Edge) -> str:
    return (
        f"{edge.where()}: {_name(edge.source)} [layer {layer(edge.source)}] imports "
        f"{_name(edge.target)} [layer {layer(edge.target)}] ({edge.kind})"
    )


def describe_cycle(cycle: list[Edge]) -> str:
    names = " -> ".join([_name(cycle[0].source)] + [_name(e.target) for e in cycle])
    lines = "".join(f"\n    {e.where()}: imports {_name(e.target)} ({e.kind})" for e in cycle)
    return f"{names}{lines}"


def problems(root: Path) -> dict[str, list[str]]:
    """Everything the layering test refuses, as readable lines, by kind."""
    modules, edges = collect_edges(root)
    return {
        "import cycles": [describe_cycle(c) for c in cycles(modules, edges)],
        "upward imports": [describe(e) for e in upward(edges) if not allowed(e)],
        "modules without a layer (add them to LAYERS in tools/layering.py)": [
            f"{modules[m].relative_to(root)}: {_name(m)}" for m in unlayered(modules)
        ],
    }


def report(root: Path, detail: bool = False) -> str:
    modules, edges = collect_edges(root)
    pairs: dict[tuple[str, str], list[Edge]] = {}
    for e in edges:
        a, b = unit(e.source), unit(e.target)
        a = a if a is not None else f"?{e.source}"
        b = b if b is not None else f"?{e.target}"
        if a != b:
            pairs.setdefault((a, b), []).append(e)
    out = [f"layer units and their imports ({root}):", "", "| from | layer | imports (layer) |", "|---|---|---|"]
    for src in sorted({a for a, _ in pairs}, key=lambda s: (layer_of_unit(s), s)):
        targets = sorted({b for a, b in pairs if a == src}, key=lambda s: (layer_of_unit(s), s))
        cells = []
        for t in targets:
            up = layer_of_unit(t) > layer_of_unit(src)
            cells.append(f"{t or '(root)'} ({_fmt(layer_of_unit(t))}){' UP' if up else ''}")
        out.append(f"| {src or '(root)'} | {_fmt(layer_of_unit(src))} | {', '.join(cells)} |")
    if detail:
        out += ["", "cross-unit module edges:"]
        for (a, b), es in sorted(pairs.items()):
            for e in es:
                out.append(f"  {describe(e)}")
    found = problems(root)
    for title, items in found.items():
        out += ["", f"{title}: {len(items)}"]
        out += [f"  {item}" for item in items]
    if ALLOWED_UPWARD:
        out += ["", f"allowed upward imports ({len(ALLOWED_UPWARD)} of at most {MAX_ALLOWED_UPWARD}):"]
        out += [f"  {_name(s)} -> {_name(t)}: {why}" for s, t, why in ALLOWED_UPWARD]
    return "\n".join(out)


def layer_of_unit(key: str) -> float:
    if key == "":
        return ROOT_LAYER
    return LAYERS.get(key, float("inf"))


def _fmt(value: float) -> str:
    return "?" if value == float("inf") else str(int(value))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    detail = "--detail" in argv
    rest = [a for a in argv if a != "--detail"]
    root = Path(rest[0]) if rest else Path(__file__).resolve().parent.parent
    print(report(root, detail=detail))
    return 1 if any(problems(root).values()) else 0


if __name__ == "__main__":
    sys.exit(main())
