"""Tool-implementation evidence for the matcher's judge (paper A.3): the source of the Python
method behind each tool (signature, docstring, body), read from the installed packages.

It helps the judge interpret arguments (defaults, normalisation, what a parameter means); it
never includes databases, task data or answers. Only the matcher sees it, never the teacher.

BFCL: the public methods of the package's environment classes (no name is defined by two
classes). tau2: the `@is_tool` methods of each domain's agent toolkit. EnvScaler: per
environment (`task_tool_evidence`, keyed by Task.evidence_scope), each tool's description,
schema and method source from the environment's class code. Environments backed by live MCP
servers (AWM, `env.name: mcp`) read theirs from the servers' tool lists through their factory's
`tool_evidence(tasks)` (matching/build.py). Other environments supply none (`tool_evidence`
returns None), so their judged pairs do not require it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import textwrap

MAX_CHARS = 6000  # per tool: a long body is cut (the signature and docstring come first)


def _source(func) -> str:
    try:
        text = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):  # no source file: fall back to signature + docstring
        text = f"def {func.__name__}{inspect.signature(func)}:\n    \"\"\"{inspect.getdoc(func) or ''}\"\"\""
    if len(text) > MAX_CHARS:
        text = text[:MAX_CHARS] + "\n# ... (cut)"
    return text


@functools.lru_cache(maxsize=None)
def bfcl_evidence() -> dict[str, str]:
    """Tool name -> source of the BFCL class method implementing it, for every class BFCL
    multi-turn tasks use (the package's CLASS_FILE_PATH_MAPPING)."""
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    from actionopd_jax.envs.bfcl_data import CATEGORIES, _entries

    used = sorted({c for cat in CATEGORIES for e in _entries(cat).values() for c in e["involved_classes"]})
    out: dict[str, str] = {}
    for class_name in used:
        cls = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)
        for name, func in inspect.getmembers(cls, predicate=inspect.isfunction):
            if not name.startswith("_"):
                out[name] = f"# {class_name}.{name}\n{_source(func)}"
    return out


def _tau2_toolkit(domain: str):
    if domain == "airline":
        from tau2.domains.airline.tools import AirlineTools as cls
    elif domain == "retail":
        from tau2.domains.retail.tools import RetailTools as cls
    elif domain == "telecom":
        from tau2.domains.telecom.tools import TelecomTools as cls
    else:
        raise ValueError(f"unknown tau2 domain '{domain}'")
    return cls


@functools.lru_cache(maxsize=None)
def tau2_evidence(domain: str) -> dict[str, str]:
    """Tool name -> source of the tau2 toolkit method behind it (the agent's tools of `domain`)."""
    from tau2.environment.toolkit import TOOL_ATTR

    cls = _tau2_toolkit(domain)
    return {name: f"# {cls.__name__}.{name}\n{_source(func)}"
            for name, func in inspect.getmembers(cls, predicate=inspect.isfunction)
            if getattr(func, TOOL_ATTR, False)}


def evidence_scope(task) -> str:
    """Which evidence table a task's tool calls are judged with: the task's own scope when its
    payload names one (AWM: "awm/<scenario>", since scenarios reuse tool names), else its env."""
    scope = (task.payload or {}).get("evidence_scope")
    return scope if isinstance(scope, str) and scope else task.env


def tool_evidence(env: str) -> dict[str, str] | None:
    """The evidence of environment `env` ("bfcl", "tau2_<domain>"); None when it has none."""
    if env == "bfcl":
        return dict(bfcl_evidence())
    if env.startswith("tau2_"):
        return dict(tau2_evidence(env[len("tau2_"):]))
    return None


def task_tool_evidence(task) -> dict[str, str] | None:
    """The evidence of the environment `task` runs in, for families whose environments each
    bring their own tools (EnvScaler); None for the others."""
    if task.env == "envscaler":
        from actionopd_jax.envs.envscaler.evidence import envscaler_evidence

        p = task.payload
        return envscaler_evidence(p.get("tools") or [], p.get("class_code", ""), p.get("class_name", ""))
    return None
