"""Running BFCL tool calls safely: per-episode instances of the package's environment classes,
methods called by name with parsed keyword arguments, and call strings for the official
checker built only from validated names and `repr` of plain JSON values.

Why the extra care: the package's own executor builds `name(args)` strings and `eval`s them,
and keeps instances in module globals keyed by model name and task id. We never eval; we give
each episode its own deep-copied instances (some classes put module-level objects from
`long_context.py` into their state, which would otherwise be shared between episodes).
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
from typing import Any

from actionopd_jax import pyast
from actionopd_jax.envs.tool_args import is_safe_identifier

# The package's executor refuses these names before eval; we refuse them too.
BLOCKED_NAMES = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})


def _class_modules() -> dict[str, str]:
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    return CLASS_FILE_PATH_MAPPING


def _stateless_classes() -> list[str]:
    from bfcl_eval.constants.executable_backend_config import STATELESS_CLASSES

    return STATELESS_CLASSES


def method_parameters(involved_classes: list[str]) -> dict[str, list[str]]:
    """Public method name -> its parameter names in positional order, read from the classes
    (later classes win name clashes, as in `BFCLInstances`)."""
    modules = _class_modules()
    out: dict[str, list[str]] = {}
    for class_name in involved_classes:
        cls = getattr(importlib.import_module(modules[class_name]), class_name)
        for name, func in inspect.getmembers(cls, predicate=inspect.isfunction):
            if name.startswith("_"):
                continue
            params = list(inspect.signature(func).parameters.values())[1:]  # drop self
            out[name] = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return out


class BFCLInstances:
    """The environment class instances of one episode.

    `methods` maps each public method name to the instance that owns it; like the package's
    executor, a later class in `involved_classes` wins a name clash.
    """

    def __init__(self, involved_classes: list[str], initial_config: dict, *, long_context: bool):
        modules = _class_modules()
        self.instances: dict[str, Any] = {}
        self.methods: dict[str, Any] = {}
        for class_name in involved_classes:
            if class_name not in modules:
                raise ValueError(f"unknown BFCL class '{class_name}'")
            cls = getattr(importlib.import_module(modules[class_name]), class_name)
            instance = cls()
            if class_name not in _stateless_classes():
                instance._load_scenario(copy.deepcopy(initial_config.get(class_name, {})), long_context=long_context)
            # Detach from module-level objects the scenario loader may have linked in.
            instance = copy.deepcopy(instance)
            self.instances[class_name] = instance
            for name, _ in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.methods[name] = instance

    def has_method(self, name: str) -> bool:
        return is_safe_identifier(name) and name in self.methods and name not in BLOCKED_NAMES

    def execute(self, name: str, arguments: dict[str, Any]) -> str:
        """Call method `name` with keyword `arguments`; returns the result as the text the
        package's executor would produce (errors included)."""
        if not self.has_method(name):
            return f"Error during execution: Function call {name} is not allowed."
        method = getattr(self.methods[name], name)
        try:
            # Deep copy: a method may store its argument objects in the instance state.
            result = method(**copy.deepcopy(arguments))
        except Exception as exc:  # the tool's own failure is the agent's observation
            return f"Error during execution: {exc}"
        return format_result(result)


def format_result(result: Any) -> str:
    """Same text conversion as the package's executor: str as is, dict as JSON, else str()."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


def call_string(name: str, arguments: dict[str, Any]) -> str:
    """`name(k=repr(v), ...)` for the official checker, which evals it.

    Only validated pieces go in: `name` and keys are public identifiers, values are plain
    JSON values whose repr is a Python literal (checked by parsing it back with
    `ast.literal_eval`, which never runs code). Anything else raises ValueError.
    """
    if not is_safe_identifier(name) or name in BLOCKED_NAMES:
        raise ValueError(f"unsafe tool name {name!r}")
    parts = []
    for key, value in arguments.items():
        if not is_safe_identifier(key):
            raise ValueError(f"unsafe argument name {key!r}")
        text = repr(value)
        if pyast.literal_eval(text) != value or not _plain(value):
            raise ValueError(f"argument {key} is not a plain JSON value")
        parts.append(f"{key}={text}")
    return f"{name}({','.join(parts)})"


def _plain(value: Any) -> bool:
    if value is None or type(value) in (bool, int, float, str):
        return True
    if type(value) is list:
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    return False


def parse_call_string(text: str, parameter_names: dict[str, list[str]]) -> tuple[str, dict[str, Any]]:
    """Parse a ground-truth call string like "sort('a.pdf')" or "cd(folder='x')" with `ast`:
    a bare function name and literal arguments only; positional arguments are named by
    `parameter_names[name]` (the method's signature order). Never evaluates code."""
    tree = pyast.parse(text.strip(), mode="eval")
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise ValueError(f"not a plain function call: {text!r}")
    name = call.func.id
    kwargs: dict[str, Any] = {}
    if call.args:
        order = parameter_names.get(name)
        if order is None or len(call.args) > len(order):
            raise ValueError(f"cannot name positional arguments of {name!r}")
        for param, node in zip(order, call.args):
            kwargs[param] = _literal(node)
    for kw in call.keywords:
        if kw.arg is None:
            raise ValueError(f"**kwargs not allowed in {text!r}")
        kwargs[kw.arg] = _literal(kw.value)
    return name, kwargs


def _literal(node: ast.AST) -> Any:
    value = ast.literal_eval(node)
    return _jsonify(value)


def _jsonify(value: Any) -> Any:
    """Tuples (written in some ground truth) become lists, as JSON would deliver them."""
    if isinstance(value, tuple):
        return [_jsonify(v) for v in value]
    if isinstance(value, list):
        return [_jsonify(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonify(v) for k, v in value.items()}
    return value
