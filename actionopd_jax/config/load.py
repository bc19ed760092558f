"""Building a checked `Config`: the defaults, then a YAML file (with its `base:` chain), then
`a.b=c` overrides, in that order; every way of building one ends in `from_dict`, which runs
the cross-field checks (config/checks.py). `experiment_changes` (what a resumed run compares
against its checkpoint) and `flatten` are the schema's, importable from here too.

The front end of the config package (it imports the schema, the files and the checks, and
through the checks the modules that own the choice lists); config.schema, config.errors and
config.experiment stay leaves that every layer may import.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from actionopd_jax.config.checks import validate
from actionopd_jax.config.build import gather_section
from actionopd_jax.config.errors import ConfigError, problems_of, raise_all
from actionopd_jax.config.files import read_config_file
from actionopd_jax.config.schema import (RESUME_SAFE_PREFIXES, Config, experiment_changes, flatten, retired_key,
                                         suggest)

# the resume comparison is defined with the schema (the trainer reads it there); named here too
__all__ = ["RESUME_SAFE_PREFIXES", "experiment_changes", "flatten", "from_dict", "load_config", "parse_override",
           "replace_keys", "set_dotted"]


def from_dict(data: dict[str, Any], found: list[tuple[str, str]] | None = None) -> Config:
    """A checked Config from a plain tree. Unknown keys, type errors and value errors come in
    one ConfigError, numbered (issue 46: they came one failed start at a time); `found` holds
    the (dotted key, message) problems an earlier stage (the file, the overrides) already
    met. A mistyped key is checked at its default, and a value check naming it is left out."""
    found = list(found or [])
    cfg = gather_section(Config, data or {}, "", found)
    try:
        validate(cfg)
        checked: list[str] = []
    except ConfigError as e:
        wrong = [key for key, _ in found if key]
        checked = [p for p in problems_of(e) if not any(_names(p, key) for key in wrong)]
    raise_all([message for _, message in found] + checked)
    return cfg


def _names(message: str, key: str) -> bool:
    """Whether `message` names the dotted `key` itself (not a longer key that contains it)."""
    return re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message) is not None


def replace_keys(cfg: Config, **dotted: Any) -> Config:
    """Copy with dotted keys changed, checked like a loaded config:
    replace_keys(cfg, **{"train.lr": 1e-5})."""
    found: list[tuple[str, str]] = []
    return from_dict(set_dotted(cfg.to_dict(), dotted, found), found)


def set_dotted(tree: dict[str, Any], dotted: dict[str, Any],
               found: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Set `a.b.c` keys in a plain config tree (in place); unknown keys are refused with the
    closest valid one: appended to `found` as (key, message) when given (the key is skipped),
    else raised, all at once."""
    valid = sorted(flatten(Config().to_dict()))
    wrong: list[tuple[str, str]] = []
    for key, value in dotted.items():
        try:
            if retired_key(key, value):
                continue
        except ConfigError as e:
            wrong.append((key, str(e)))
            continue
        parts = key.split(".")
        node = tree
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or parts[-1] not in node:
            wrong.append((key, f"unknown config key {key!r}" + suggest(key, valid)))
            continue
        node[parts[-1]] = value
    if found is None:
        raise_all([message for _, message in wrong])
    else:
        found.extend(wrong)
    return tree


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=c' -> ("a.b", value parsed as YAML: numbers, true/false, [lists], strings)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file (if any, with its `base:` chain), then `a.b=c` overrides;
    every wrong key and value of all three is reported in one error."""
    found: list[tuple[str, str]] = []
    tree = Config().to_dict()
    if path:
        set_dotted(tree, flatten(read_config_file(path, found=found)), found)
    parsed = {}
    for text in overrides:
        try:
            key, value = parse_override(text)
        except ConfigError as e:
            found.append(("", str(e)))
            continue
        parsed[key] = value
    set_dotted(tree, parsed, found)
    return from_dict(tree, found)
