"""The package's imports run one way: no module-import cycle, nothing imports a higher layer.

The layer table, the allow-list and the analysis are in tools/layering.py (runnable:
`python tools/layering.py [--detail]`); docs/architecture.md explains the layers. Pure `ast`:
no jax import, well under a second.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_tool():
    spec = importlib.util.spec_from_file_location("_layering_tool", ROOT / "tools" / "layering.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


layering = _load_tool()


def _fail(title: str, items: list[str]) -> None:
    if items:
        pytest.fail(f"{title} ({len(items)}):\n" + "\n".join(items), pytrace=False)


def test_no_import_cycles():
    _fail("module-import cycles (in-function imports count)", layering.problems(ROOT)["import cycles"])


def test_imports_run_downward():
    _fail(
        "imports of a higher layer (importer, line, target; see LAYERS in tools/layering.py)",
        layering.problems(ROOT)["upward imports"],
    )


def test_every_module_has_a_layer():
    key = next(k for k in layering.problems(ROOT) if k.startswith("modules without a layer"))
    _fail(key, layering.problems(ROOT)[key])


def test_allow_list_is_short_and_explained():
    allowed = layering.ALLOWED_UPWARD
    assert len(allowed) <= layering.MAX_ALLOWED_UPWARD == 4
    modules, edges = layering.collect_edges(ROOT)
    present = {(e.source, e.target) for e in edges}
    for source, target, reason in allowed:
        assert reason.strip(), f"allowed upward import {source} -> {target} needs a reason"
        assert (source, target) in present, f"allowed upward import {source} -> {target} no longer exists: drop it"
        assert layering.layer(target) > layering.layer(source), f"{source} -> {target} is not upward"


def test_layer_table_matches_its_order():
    # longest prefix wins: a sub-unit may sit above or below its package (config.load vs config)
    assert layering.unit("config.load") == "config.load" and layering.layer("config.load") == 15
    assert layering.layer("config.schema") == 0 and layering.layer("config") == 0
    assert layering.layer("config_checks") is None  # prefixes are dotted, not textual
    assert layering.layer("model.attention.splash") == 3


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "actionopd_jax" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_analysis_sees_every_kind_of_import(tmp_path):
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "types.py": "",
            "model/__init__.py": "from .core import Model\n",  # re-export: model -> model.core
            "model/core.py": "from .. import types\n",  # relative, two levels
            "sampling/__init__.py": "",
            "sampling/loading.py": (
                "import importlib\n"
                "def load():\n"
                "    from actionopd_jax.train import run_model\n"  # in-function, submodule by name
                "    return importlib.import_module('actionopd_jax.collect')\n"  # by string
            ),
            "train/__init__.py": "",
            "train/run_model.py": "from actionopd_jax.model import Model\n",  # name -> the __init__
            "collect/__init__.py": "_EXPORTS = {'x': 'actionopd_jax.collect.impl'}\n",
            "collect/impl.py": "from actionopd_jax.sampling.loading import load\n",
            "envs/__init__.py": "",
            "envs/a.py": "from .b import f\n",
            "envs/b.py": "def f():\n    from actionopd_jax.envs import a\n",
        },
    )
    modules, edges = layering.collect_edges(root)
    found = {(e.source, e.target, e.kind) for e in edges}
    assert ("model", "model.core", "module level") in found
    assert ("model.core", "types", "module level") in found
    assert ("sampling.loading", "train.run_model", "in function") in found
    assert ("sampling.loading", "collect", "string") in found
    assert ("train.run_model", "model", "module level") in found
    assert ("collect", "collect.impl", "string") in found
    up = {(e.source, e.target, e.line) for e in layering.upward(edges)}
    assert up == {("sampling.loading", "train.run_model", 3), ("sampling.loading", "collect", 4)}
    text = "\n".join(layering.problems(root)["import cycles"])
    assert "actionopd_jax.envs.a -> actionopd_jax.envs.b -> actionopd_jax.envs.a" in text
    assert "actionopd_jax/envs/b.py:2" in text
    # collect -> collect.impl -> sampling.loading -> collect (by string) is a cycle too
    assert "actionopd_jax/sampling/loading.py:4: imports actionopd_jax.collect (string)" in text
