"""Config files: a YAML file and its `base:` chain, merged into one tree of settings.

`base: other.yaml` (relative to the file that names it) is loaded first and the file's own
keys override it, section by section, recursively; lists and scalars are replaced whole. Each
file's keys are checked on their own, so an unknown key names the file it is in; a missing
base and cycles are refused with the chain that led there. The few path settings in
FILE_RELATIVE_KEYS are relative to the file that names them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from actionopd_jax.config.build import drop_keys, gather_section
from actionopd_jax.config.errors import ConfigError, raise_all
from actionopd_jax.config.schema import Config


def _read_yaml(p: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    return loaded


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, section by section (lists and scalars are replaced whole)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Path settings that a config file names relative to itself (data shipped next to a recipe).
FILE_RELATIVE_KEYS = (("teacher", "privileged_summaries"),)


def _resolve_file_relative(loaded: dict[str, Any], folder: Path) -> None:
    for section, key in FILE_RELATIVE_KEYS:
        values = loaded.get(section)
        value = values.get(key) if isinstance(values, dict) else None
        if isinstance(value, str) and value and not Path(value).is_absolute():
            loaded[section] = {**values, key: str((folder / value).resolve())}


def read_config_file(path: str | Path, _chain: tuple[Path, ...] = (),
                     found: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """A YAML config with its `base:` chain resolved: `base: other.yaml` (relative to the file
    that names it) is loaded first and this file's keys override it, recursively. Each file's
    keys are checked on their own, so an unknown key names the file it is in. With `found`,
    its wrong keys (unknown, mistyped) are appended there as (dotted key, message) and left
    out of the tree, for the caller to report with the rest; without, they are raised, all at
    once."""
    p = Path(path).resolve()
    if p in _chain:
        raise ConfigError("config files include each other in a cycle: " + " -> ".join(
            str(x) for x in (*_chain, p)))
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist" if not _chain else
                          f"{_chain[-1]}: base {p} does not exist (base paths are relative to the file "
                          "that names them)")
    loaded = _read_yaml(p)
    base = loaded.pop("base", None)
    wrong: list[tuple[str, str]] = []
    gather_section(Config, loaded, "", wrong)  # unknown keys / types in this file are reported as such
    if wrong and found is None:
        raise_all([f"{p}: {message}" for _, message in wrong])
    if wrong:
        found.extend((key, f"{p}: {message}") for key, message in wrong)
        drop_keys(loaded, [key for key, _ in wrong])
    _resolve_file_relative(loaded, p.parent)
    if base is None:
        return loaded
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{p}: base must be the path of another config file, got {base!r}")
    return _merge(read_config_file(p.parent / base, (*_chain, p), found), loaded)
