"""The typed tree builder: a plain tree (YAML, overrides) into the frozen sections. Unknown keys
are errors that name the key and suggest the closest valid one; values are checked (and gently
converted) against the field types; keys the schema retired load unchanged where their value
meant what the code does now.

A leaf of the config package: it takes the section class as an argument and imports no section.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from actionopd_jax.config.errors import ConfigError, raise_all
from actionopd_jax.config.eval_section import RETIRED_EVAL_KEYS


def suggest(key: str, valid: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return f"; did you mean {prefix + close[0]!r}?"
    return f"; valid keys here: {', '.join(prefix + v for v in sorted(valid))}"


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check (and gently convert) a value against a field type; errors name the key."""
    origin = typing.get_origin(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):  # e.g. a budget given as a number
            return str(value)
        if value is None:
            return ""
        if isinstance(value, bool):
            # YAML 1.1 reads a bare on/off (yes/no, true/false) as a boolean, in files and in
            # `key=value` overrides alike: `matcher.execution: off` and `run.distributed.mode=on`
            # mean the words; a field that does not take them is refused by its value check
            return "on" if value else "off"
        raise ConfigError(f"{where}: expected a string, got {value!r} ({type(value).__name__})")
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        others = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(others) != 1 or len(typing.get_args(hint)) != 2:
            raise ConfigError(f"{where}: unsupported union type")  # only `X | None` is used
        return None if value is None else _coerce(value, others[0], where)
    raise ConfigError(f"{where}: unsupported field type {hint}")


def retired_key(dotted: str, value: Any) -> bool:
    """True for a key the schema no longer has, given the value that meant what the code does
    now (an older config, or a run's saved config.yaml, loads unchanged: the key is dropped);
    ConfigError saying where the setting went for any other value; False for any other key."""
    section, _, key = dotted.partition(".")
    if section != "eval" or key not in RETIRED_EVAL_KEYS:
        return False
    meant, where = RETIRED_EVAL_KEYS[key]
    if value == meant:
        return True
    raise ConfigError(f"{dotted}={value!r} is no longer a setting: {where}")


def build_section(cls, data: dict[str, Any], prefix: str):
    """`cls` (a section dataclass or `Config`) from a plain tree, keys and types checked; one
    ConfigError names every wrong key at once. The cross-field checks are not run here
    (config.load.from_dict runs them)."""
    found: list[tuple[str, str]] = []
    built = gather_section(cls, data, prefix, found)
    raise_all([message for _, message in found])
    return built


def gather_section(cls, data: Any, prefix: str, found: list[tuple[str, str]]):
    """`cls` built from the keys of `data` that are right, each wrong one (unknown, retired with
    another value, of the wrong type) left at its default and appended to `found` as (dotted
    key, message): the caller reports them with the value checks in one list, rather than one
    per failed start."""
    where = prefix.rstrip(".")
    if not isinstance(data, dict):
        found.append((where, f"{where or 'config'}: expected a mapping of keys, got {data!r}"))
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        try:
            if key not in names and retired_key(full, value):
                continue
            if key not in names:
                raise ConfigError(f"unknown config key {full!r}" + suggest(key, names, prefix))
            hint = hints[key]
            if dataclasses.is_dataclass(hint):
                kwargs[key] = gather_section(hint, value or {}, f"{full}.", found)
            else:
                kwargs[key] = _coerce(value, hint, full)
        except ConfigError as e:
            found.append((full, str(e)))
    return cls(**kwargs)


def drop_keys(tree: dict[str, Any], dotted: list[str]) -> None:
    """Remove dotted keys from a plain tree (in place): the wrong keys `gather_section` already
    reported, so a later pass over the same tree does not report them again."""
    for key in dotted:
        *parents, last = key.split(".")
        node: Any = tree
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
