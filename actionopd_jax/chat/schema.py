"""Validate tool-call arguments against a tool's JSON schema (the subset tool schemas use).

Supported: type (string, integer, number, boolean, object, array, null, lists of types, and
the aliases BFCL function docs use: dict, float, tuple, any, ...), enum, const, required,
properties, additionalProperties, minProperties/maxProperties, items (schema or positional
list), prefixItems, minItems/maxItems, minLength/maxLength, minimum/maximum,
exclusiveMinimum/exclusiveMaximum, anyOf, oneOf, allOf, not, nullable (OpenAPI), boolean
schemas, and local `$ref` ("#/$defs/Name", as pydantic writes them). Annotations (description,
title, default, format, examples) carry no constraint. `pattern` is not enforced: matching a
schema regex against untrusted model output could backtrack for a very long time.

Booleans are never numbers (Python's bool is an int: handled explicitly); an integral float
such as 3.0 is an integer, as JSON Schema says.
"""

from __future__ import annotations

import math
from typing import Any

# Schemas nest far less than this; the bound stops $ref cycles and pathological schemas.
MAX_SCHEMA_DEPTH = 100

# BFCL and other function docs use programming-language type names; map them (lower-cased).
_TYPE_ALIASES = {
    "dict": "object", "map": "object", "hashmap": "object",
    "float": "number", "double": "number",
    "int": "integer", "long": "integer",
    "bool": "boolean",
    "str": "string", "char": "string",
    "tuple": "array", "list": "array", "arraylist": "array",
    "any": "any",
}
_KNOWN_TYPES = {"string", "integer", "number", "boolean", "object", "array", "null", "any"}


class SchemaError(ValueError):
    """The tool schema itself is broken (not the arguments): a configuration error."""


def validate_arguments(arguments: Any, schema: dict | bool | None) -> str | None:
    """None if `arguments` (a decoded JSON object) satisfies `schema`, else a short reason
    naming the offending path, e.g. "arguments.passengers[0].dob: expected string, got 3".
    A missing schema (tool without parameters) accepts any object."""
    if not isinstance(arguments, dict):
        return f"arguments: expected an object, got {_describe(arguments)}"
    if schema is None:
        return None
    return _check(arguments, schema, "arguments", root=schema, depth=0)


def json_type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def json_equal(a: Any, b: Any) -> bool:
    """Equality of decoded JSON values where true != 1 and 1 == 1.0 (JSON semantics)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{json_type_name(value)} {text}"


def _matches_type(value: Any, type_name: str) -> bool:
    if type_name == "any":
        return True
    if type_name == "string":
        return isinstance(value, str)
    if type_name == "boolean":
        return isinstance(value, bool)
    if type_name == "null":
        return value is None
    if type_name == "object":
        return isinstance(value, dict)
    if type_name == "array":
        return isinstance(value, list)
    if isinstance(value, bool):
        return False
    if type_name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if type_name == "number":
        return isinstance(value, (int, float))
    return True  # unknown type names (e.g. Java class names in some docs) carry no constraint


def _normalize_type(name: Any, path: str) -> str:
    if not isinstance(name, str):
        raise SchemaError(f"schema at {path}: 'type' must be a string or a list of strings, got {name!r}")
    lowered = name.lower()
    return _TYPE_ALIASES.get(lowered, lowered)


def _resolve_ref(ref: Any, root: Any, path: str) -> Any:
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaError(f"schema at {path}: only local $ref ('#/...') is supported, got {ref!r}")
    node = root
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise SchemaError(f"schema at {path}: $ref {ref!r} does not resolve")
    return node


def _check(value: Any, schema: Any, path: str, *, root: Any, depth: int) -> str | None:
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaError(f"schema at {path}: nested deeper than {MAX_SCHEMA_DEPTH} (a $ref cycle?)")
    if schema is True:
        return None
    if schema is False:
        return f"{path}: no value is allowed here"
    if not isinstance(schema, dict):
        raise SchemaError(f"schema at {path} must be an object or a boolean, got {type(schema).__name__}")

    def sub(v: Any, s: Any, p: str) -> str | None:
        return _check(v, s, p, root=root, depth=depth + 1)

    if "$ref" in schema:
        reason = sub(value, _resolve_ref(schema["$ref"], root, path), path)
        if reason:
            return reason
    if value is None and schema.get("nullable") is True:
        return None

    if "type" in schema:
        declared = schema["type"]
        names = declared if isinstance(declared, list) else [declared]
        normalized = [_normalize_type(n, path) for n in names]
        if not any(_matches_type(value, n) for n in normalized):
            want = " or ".join(names) if all(isinstance(n, str) for n in names) else str(names)
            return f"{path}: expected {want}, got {_describe(value)}"

    if "enum" in schema:
        options = schema["enum"]
        if not isinstance(options, list):
            raise SchemaError(f"schema at {path}: 'enum' must be a list")
        if not any(json_equal(value, option) for option in options):
            shown = ", ".join(repr(o) for o in options[:10]) + (", ..." if len(options) > 10 else "")
            return f"{path}: {_describe(value)} is not one of [{shown}]"
    if "const" in schema and not json_equal(value, schema["const"]):
        return f"{path}: expected {schema['const']!r}, got {_describe(value)}"

    reason = _check_combinators(value, schema, path, sub)
    if reason:
        return reason
    if isinstance(value, dict):
        return _check_object(value, schema, path, sub)
    if isinstance(value, list):
        return _check_array(value, schema, path, sub)
    if isinstance(value, str):
        return _check_string(value, schema, path)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _check_number(value, schema, path)
    return None


def _check_combinators(value: Any, schema: dict, path: str, sub) -> str | None:
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema and (not isinstance(schema[key], list) or not schema[key]):
            raise SchemaError(f"schema at {path}: '{key}' must be a non-empty list")
    if "allOf" in schema:
        for i, option in enumerate(schema["allOf"]):
            reason = sub(value, option, path)
            if reason:
                return reason
    if "anyOf" in schema:
        reasons = [sub(value, option, path) for option in schema["anyOf"]]
        if all(reasons):
            return f"{path}: matches none of the allowed forms (anyOf); first mismatch: {reasons[0]}"
    if "oneOf" in schema:
        reasons = [sub(value, option, path) for option in schema["oneOf"]]
        passing = sum(r is None for r in reasons)
        if passing == 0:
            return f"{path}: matches none of the allowed forms (oneOf); first mismatch: {reasons[0]}"
        if passing > 1:
            return f"{path}: matches {passing} forms of a oneOf, exactly one is allowed"
    if "not" in schema and sub(value, schema["not"], path) is None:
        return f"{path}: {_describe(value)} matches a form that is not allowed"
    return None


def _check_object(value: dict, schema: dict, path: str, sub) -> str | None:
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise SchemaError(f"schema at {path}: 'properties' must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list):
        raise SchemaError(f"schema at {path}: 'required' must be a list of names")
    for name in required:
        if name not in value:
            return f"{path}: missing required argument {name!r}"
    extra_schema = schema.get("additionalProperties", True)
    for key, item in value.items():
        item_path = f"{path}.{key}"
        if key in properties:
            reason = sub(item, properties[key], item_path)
        elif extra_schema is False:
            allowed = ", ".join(sorted(properties)) or "none"
            return f"{path}: unexpected argument {key!r} (allowed: {allowed})"
        else:
            reason = sub(item, extra_schema, item_path)
        if reason:
            return reason
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        return f"{path}: needs at least {schema['minProperties']} entries, got {len(value)}"
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        return f"{path}: allows at most {schema['maxProperties']} entries, got {len(value)}"
    return None


def _check_array(value: list, schema: dict, path: str, sub) -> str | None:
    if "minItems" in schema and len(value) < schema["minItems"]:
        return f"{path}: needs at least {schema['minItems']} items, got {len(value)}"
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        return f"{path}: allows at most {schema['maxItems']} items, got {len(value)}"
    items = schema.get("items")
    positional = schema.get("prefixItems", items if isinstance(items, list) else None)
    start = 0
    if positional is not None:
        for i, (item, item_schema) in enumerate(zip(value, positional)):
            reason = sub(item, item_schema, f"{path}[{i}]")
            if reason:
                return reason
        start = len(positional)
        rest = schema.get("additionalItems", True) if isinstance(items, list) else schema.get("items", True)
    else:
        rest = items if items is not None else True
    for i in range(start, len(value)):
        reason = sub(value[i], rest, f"{path}[{i}]")
        if reason:
            return reason
    return None


def _check_string(value: str, schema: dict, path: str) -> str | None:
    if "minLength" in schema and len(value) < schema["minLength"]:
        return f"{path}: must be at least {schema['minLength']} characters long"
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        return f"{path}: must be at most {schema['maxLength']} characters long"
    return None


def _check_number(value: int | float, schema: dict, path: str) -> str | None:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    ex_lo, ex_hi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    # draft-4 spelled exclusivity as a boolean next to minimum/maximum
    if ex_lo is True:
        ex_lo, lo = lo, None
    if ex_hi is True:
        ex_hi, hi = hi, None
    if _is_number(lo) and value < lo:
        return f"{path}: must be >= {lo}, got {value!r}"
    if _is_number(hi) and value > hi:
        return f"{path}: must be <= {hi}, got {value!r}"
    if _is_number(ex_lo) and value <= ex_lo:
        return f"{path}: must be > {ex_lo}, got {value!r}"
    if _is_number(ex_hi) and value >= ex_hi:
        return f"{path}: must be < {ex_hi}, got {value!r}"
    return None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
