"""The shipped configs, wherever they live under configs/: tests name them by file name.

`configs/` is sorted for users (paper/, tiny/, compare/); a test asks for `CONFIGS / "name.yaml"`
and gets the one file of that name, so moving a file between folders changes no test.
SHIPPED lists the training configs (every `actionopd train --config` file); a file with a
top-level `compare:` section is a compare preset (`actionopd compare`), listed in COMPARE.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"

_FILES = sorted(CONFIG_DIR.rglob("*.yaml"))
_BY_NAME = {p.name: p for p in _FILES}
assert len(_BY_NAME) == len(_FILES), f"two shipped configs share a file name: {[str(p) for p in _FILES]}"


def _is_compare_preset(path: Path) -> bool:
    return re.search(r"^compare:", path.read_text(), flags=re.MULTILINE) is not None


class _Configs:
    """`CONFIGS / "qwen3_4b_tpu.yaml"` -> the shipped file of that name, in whichever folder."""

    def __truediv__(self, name: str) -> Path:
        try:
            return _BY_NAME[name]
        except KeyError:
            raise FileNotFoundError(f"no shipped config named {name!r} under {CONFIG_DIR}") from None

    def __repr__(self) -> str:
        return f"shipped configs under {CONFIG_DIR}"


CONFIGS = _Configs()
SHIPPED = sorted(name for name, path in _BY_NAME.items() if not _is_compare_preset(path))
COMPARE = sorted(name for name, path in _BY_NAME.items() if _is_compare_preset(path))


def repo_path(name: str) -> str:
    """The config's path relative to the checkout, as a user types it: 'configs/paper/x.yaml'."""
    return str((CONFIGS / name).relative_to(ROOT))
