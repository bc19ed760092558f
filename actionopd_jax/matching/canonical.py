"""Canonical comparison of tool-call arguments (paper appendix A.3, "Semantic matching").

The rules, each a deliberate choice:
- the tool name must be identical (no case folding: tool names are identifiers);
- dictionary key order is ignored;
- an integral float equals the integer of the same value (``1.0 == 1``, ``-0.0 == 0``);
- booleans are never numbers (``True != 1``, ``False != 0``), although Python says otherwise;
- a missing key is not a key holding ``null``;
- list order and multiplicity are kept (``[1, 2] != [2, 1]``, ``[1] != [1, 1]``);
- strings are compared exactly; spelling variants ("Paris" / "paris") are left to the judge.

`canonical_json` gives a deterministic text for a value under these rules (equal values have
equal texts, and vice versa), used for cache keys and for de-duplicating judge calls.
`differing_paths` lists where two argument objects differ, as JSON paths (``$.a.b[2]``),
which the judge prompt receives so it knows what to look at.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from actionopd_jax.types import ToolCall

# Deep argument objects are untrusted model output: stop descending at this depth and
# compare the rest by canonical text, so recursion can never blow the stack.
_MAX_DEPTH = 64
_SIMPLE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def canonical_value(v: Any, _depth: int = 0) -> Any:
    """A plain-JSON value where equal-under-the-rules inputs become identical.

    Integral floats become ints; non-finite floats become tagged strings (JSON has no NaN,
    and NaN must equal NaN here so identical calls match); dict keys are sorted by
    json.dumps(sort_keys=True) later; tuples become lists. Subtrees deeper than
    _MAX_DEPTH are kept as raw text (untrusted output must not exhaust the stack).
    """
    if _depth > _MAX_DEPTH:
        # Past the depth limit the subtree is kept as raw text: still deterministic, and
        # `_diff` uses the same fallback, so equality stays consistent with this function.
        return {"$deep": canonical_json_shallow(v)}
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if math.isnan(v):
            return {"$float": "nan"}
        if math.isinf(v):
            return {"$float": "inf" if v > 0 else "-inf"}
        return int(v) if v.is_integer() else v
    if isinstance(v, dict):
        return {str(k): canonical_value(x, _depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [canonical_value(x, _depth + 1) for x in v]
    raise TypeError(f"not a JSON value: {type(v).__name__}")


def canonical_json(v: Any) -> str:
    """Deterministic text of `v` under the canonical rules (sorted keys, no whitespace)."""
    return json.dumps(canonical_value(v), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def values_equal(a: Any, b: Any) -> bool:
    """Equality under the canonical rules."""
    return not differing_paths(a, b)


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if _SIMPLE_KEY.match(key):
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def _scalar_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a is b
    if _is_number(a) and _is_number(b):
        ca, cb = canonical_value(a), canonical_value(b)
        # int vs float compare by value in Python; canonical_value made 1.0 -> 1 already,
        # so a remaining int/float pair is e.g. 1 vs 1.5 and differs.
        return type(ca) is type(cb) and ca == cb
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, str) and isinstance(b, str):
        return a == b
    return False


def differing_paths(a: Any, b: Any, path: str = "$") -> list[str]:
    """JSON paths at which `a` and `b` differ (empty list: canonically equal).

    A key present on one side only is reported at its own path; lists of different length
    report the indices beyond the shorter one.
    """
    out: list[str] = []
    _diff(a, b, path, out, 0)
    return out


def _diff(a: Any, b: Any, path: str, out: list[str], depth: int) -> None:
    if depth > _MAX_DEPTH:
        # Beyond this depth fall back to whole-subtree text comparison (no recursion).
        if canonical_json_shallow(a) != canonical_json_shallow(b):
            out.append(path)
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                out.append(_child(path, str(key)))
            else:
                _diff(a[key], b[key], _child(path, str(key)), out, depth + 1)
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b):
                out.append(_child(path, i))
            else:
                _diff(a[i], b[i], _child(path, i), out, depth + 1)
        return
    if isinstance(a, (dict, list, tuple)) or isinstance(b, (dict, list, tuple)):
        out.append(path)  # container vs scalar, or dict vs list
        return
    if not _scalar_equal(a, b):
        out.append(path)


def canonical_json_shallow(v: Any) -> str:
    """json.dumps without canonicalization, for subtrees past the depth limit."""
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


@dataclass(frozen=True)
class ToolCallComparison:
    """Outcome of the programmatic check of two tool calls.

    same_name False: the calls can never match. equal True: canonically identical.
    Otherwise `paths` lists the differing argument paths the judge must assess.
    """

    same_name: bool
    equal: bool
    paths: tuple[str, ...] = ()


def compare_tool_calls(student: ToolCall, teacher: ToolCall) -> ToolCallComparison:
    if student.name != teacher.name:
        return ToolCallComparison(same_name=False, equal=False)
    paths = tuple(differing_paths(student.arguments, teacher.arguments))
    return ToolCallComparison(same_name=True, equal=not paths, paths=paths)
