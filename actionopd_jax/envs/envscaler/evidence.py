"""The matcher's tool evidence for an EnvScaler environment (paper A.3): each tool's description
and parameter schema, plus the source of the class method that implements it.

The source is cut out of the class code with `ast` (parsed, never executed: the code is
machine-generated and runs only in the sandbox). A tool whose method is not found in the
class keeps its description and schema.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from actionopd_jax import pyast

MAX_SOURCE_CHARS = 6000  # per method, as envs/evidence.py cuts installed sources


def method_sources(class_code: str, class_name: str) -> dict[str, str]:
    """Method name -> its source text in class `class_name` (the first class when the name is
    not found); {} when the code does not parse."""
    try:
        tree = pyast.parse(class_code)
    except SyntaxError:
        return {}
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    cls = next((c for c in classes if c.name == class_name), None) or (classes[-1] if classes else None)
    if cls is None:
        return {}
    out = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            text = ast.get_source_segment(class_code, node) or ""
            if len(text) > MAX_SOURCE_CHARS:
                text = text[:MAX_SOURCE_CHARS] + "\n# ... (cut)"
            out[node.name] = text
    return out


def evidence_text(tool: dict[str, Any], class_name: str, source: str | None) -> str:
    fn = tool["function"]
    text = (f"# EnvScaler tool {class_name}.{fn['name']}\n# description: {fn.get('description', '')}\n"
            f"# parameters:\n{json.dumps(fn.get('parameters', {}), indent=1, sort_keys=True)}")
    if source:
        text += f"\n# implementation:\n{source}"
    return text


def envscaler_evidence(tools: list[dict[str, Any]], class_code: str, class_name: str) -> dict[str, str]:
    """Tool name -> evidence text, for every tool the environment lists."""
    sources = method_sources(class_code, class_name)
    return {t["function"]["name"]: evidence_text(t, class_name, sources.get(t["function"]["name"])) for t in tools}
