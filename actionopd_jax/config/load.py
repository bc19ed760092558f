"""Building a checked `Config`: the defaults, then a YAML file (with its `base:` chain), then
`a.b=c` overrides, in that order; every way of building one ends in `from_dict`, which runs
the cross-field checks (config/checks.py). `experiment_changes` (what a resumed run compares
against its checkpoint) and `flatten` are the schema's, importable from here too.

The front end of the config package (it imports the schema, the files and the checks, and
through the checks the modules that own the choice lists); config.schema, config.errors and
config.experiment stay leaves that every layer may import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from actionopd_jax.config.checks import validate
from actionopd_jax.config.errors import ConfigError
from actionopd_jax.config.files import read_config_file
from actionopd_jax.config.schema import (RESUME_SAFE_PREFIXES, Config, build_section, experiment_changes, flatten,
                                         retired_key, suggest)

# the resume comparison is defined with the schema (the trainer reads it there); named here too
__all__ = ["RESUME_SAFE_PREFIXES", "experiment_changes", "flatten", "from_dict", "load_config", "parse_override",
           "replace_keys", "set_dotted"]


def from_dict(data: dict[str, Any]) -> Config:
    cfg = build_section(Config, data or {}, "")
    validate(cfg)
    return cfg


def replace_keys(cfg: Config, **dotted: Any) -> Config:
    """Copy with dotted keys changed, checked like a loaded config:
    replace_keys(cfg, **{"train.lr": 1e-5})."""
    return from_dict(set_dotted(cfg.to_dict(), dotted))


def set_dotted(tree: dict[str, Any], dotted: dict[str, Any]) -> dict[str, Any]:
    """Set `a.b.c` keys in a plain config tree (in place); unknown keys are refused with the
    closest valid one."""
    valid = sorted(flatten(Config().to_dict()))
    for key, value in dotted.items():
        if retired_key(key, value):
            continue
        parts = key.split(".")
        node = tree
        for part in parts[:-1]:
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                raise ConfigError(f"unknown config key {key!r}" + suggest(key, valid))
            node = nxt
        if parts[-1] not in node:
            raise ConfigError(f"unknown config key {key!r}" + suggest(key, valid))
        node[parts[-1]] = value
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
    """Defaults, then the YAML file (if any, with its `base:` chain), then `a.b=c` overrides."""
    tree = Config().to_dict()
    if path:
        set_dotted(tree, flatten(read_config_file(path)))
    set_dotted(tree, dict(parse_override(o) for o in overrides))
    return from_dict(tree)
