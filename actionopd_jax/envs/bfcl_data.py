"""BFCL multi-turn data, read from the installed `bfcl-eval` package: task entries (with the
package's own function-doc population and held-out functions), ground truth, and the function
docs converted to OpenAI tool schemas."""

from __future__ import annotations

import copy
import functools
from typing import Any

from actionopd_jax.types import Task, ToolSchema

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
ENV_NAME = "bfcl"


def category_of(task_id: str) -> str:
    """'multi_turn_long_context_12' -> 'long_context'."""
    prefix = task_id.rsplit("_", 1)[0]
    if not prefix.startswith("multi_turn_") or prefix[len("multi_turn_"):] not in CATEGORIES:
        raise ValueError(f"'{task_id}' is not a BFCL multi-turn task id (categories: {', '.join(CATEGORIES)})")
    return prefix[len("multi_turn_"):]


@functools.lru_cache(maxsize=None)
def _entries(category: str) -> dict[str, dict]:
    from bfcl_eval.utils import load_dataset_entry  # the package's loader fills `function` and `missed_function`

    return {e["id"]: e for e in load_dataset_entry(f"multi_turn_{category}")}


@functools.lru_cache(maxsize=None)
def _ground_truth(category: str) -> dict[str, list[list[str]]]:
    from bfcl_eval.utils import load_ground_truth_entry

    return {g["id"]: g["ground_truth"] for g in load_ground_truth_entry(f"multi_turn_{category}")}


def load_entry(task_id: str) -> dict:
    """A private deep copy of the dataset entry (question turns, initial config, classes,
    function docs, held-out functions). Hidden: never hand it to the agent."""
    entries = _entries(category_of(task_id))
    if task_id not in entries:
        raise KeyError(f"BFCL task '{task_id}' not found")
    return copy.deepcopy(entries[task_id])


def ground_truth(task_id: str) -> list[list[str]]:
    """Per turn, the ground-truth call strings (e.g. "cd(folder='document')")."""
    return copy.deepcopy(_ground_truth(category_of(task_id))[task_id])


def task_ids(categories: tuple[str, ...] | list[str] = CATEGORIES) -> list[str]:
    out = []
    for cat in categories:
        if cat not in CATEGORIES:
            raise ValueError(f"unknown BFCL category '{cat}'; choose from {', '.join(CATEGORIES)}")
        out.extend(sorted(_entries(cat), key=lambda i: int(i.rsplit("_", 1)[1])))
    return out


def bfcl_tasks(categories: tuple[str, ...] | list[str] = CATEGORIES, split: str = "test") -> list[Task]:
    """Task records for the chosen categories. The payload names the task only: the
    environment loads its hidden parts itself."""
    return [Task(task_id=i, env=ENV_NAME, split=split, payload={"category": category_of(i)}) for i in task_ids(categories)]


# BFCL function docs use Python-ish type names; OpenAI tools use JSON-schema names.
_TYPE_MAP = {
    "integer": "integer", "int": "integer", "number": "number", "float": "number", "double": "number",
    "string": "string", "str": "string", "boolean": "boolean", "bool": "boolean",
    "array": "array", "list": "array", "tuple": "array", "dict": "object", "object": "object",
}


def _convert_schema(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "type" and isinstance(value, str):
            out[key] = _TYPE_MAP.get(value, "string")
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _convert_schema(sub) for name, sub in value.items()}
        elif key == "items":
            out[key] = _convert_schema(value)
        else:
            out[key] = copy.deepcopy(value)
    if "properties" in out and "type" not in out:
        out["type"] = "object"
    return out


def to_openai_tool(func_doc: dict) -> ToolSchema:
    """One BFCL function doc -> {"type": "function", "function": {name, description, parameters}}.
    The doc's `response` block is dropped: OpenAI tools have no return schema."""
    params = _convert_schema(func_doc.get("parameters") or {"type": "dict", "properties": {}})
    params["type"] = "object"
    params.setdefault("properties", {})
    return {
        "type": "function",
        "function": {"name": func_doc["name"], "description": func_doc.get("description", ""), "parameters": params},
    }
