"""The suite's time budget: every test within 120 s (pytest-timeout, pyproject.toml), except
the few listed here with the reason and their own limit, so a new slow test fails at once
instead of pushing the suite toward CI's 90-minute wall."""

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 120
# test id -> (its limit, why it may take longer)
EXCEPTIONS = {
    "tests/test_experiment_main_job.py::test_short_main_job_through_the_cli":
        (300, "the whole main job in a subprocess: KD warm start, an ActionOPD step, eval before and after"),
}


def _pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@functools.cache
def _test_modules() -> dict[str, tuple[str, ast.Module]]:
    """`tests/test_x.py` -> (its source, its syntax tree), for every test module, parsed once."""
    out = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        text = path.read_text()
        out[path.relative_to(ROOT).as_posix()] = (text, ast.parse(text))
    return out


def _timeout_markers() -> dict[str, int]:
    """test id -> N of every `pytest.mark.timeout(N)` on a test function (or `pytestmark` of a
    module: id `path::*`)."""
    found = {}
    for rel, (_, tree) in _test_modules().items():
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                targets = [(f"{rel}::{node.name}", d) for d in node.decorator_list]
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
                values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                targets = [(f"{rel}::*", v) for v in values]
            for name, expr in targets:
                if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "timeout"
                        and expr.args and isinstance(expr.args[0], ast.Constant)):
                    found[name] = expr.args[0].value
    return found


def test_every_test_has_the_suite_limit():
    assert _pyproject()["tool"]["pytest"]["ini_options"]["timeout"] == LIMIT_S
    import pytest_timeout  # noqa: F401 - the test extra installs it; without it the limit is not enforced


def test_only_the_listed_tests_may_take_longer():
    longer = {name: n for name, n in _timeout_markers().items() if n > LIMIT_S}
    assert longer == {name: limit for name, (limit, _) in EXCEPTIONS.items()}, (
        "a test with a limit over 120 s must be listed in tests/test_suite_budget.py with its reason: "
        f"{longer}")


def _test_functions() -> dict[str, ast.FunctionDef]:
    """`tests/test_x.py::test_name` -> its definition, for every test module."""
    return {f"{rel}::{node.name}": node for rel, (_, tree) in _test_modules().items() for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}


def test_the_extended_tier_is_the_listed_tests_each_with_its_reason_and_a_ci_cover():
    """tests/_tiers.py is the whole extended tier: every entry and every cover is a test that
    exists, a cover still runs in CI's tier, and no module marks `extended` by itself."""
    from tests._tiers import EXTENDED, extended_id

    tests = _test_functions()
    for name, (why, covers) in EXTENDED.items():
        base, _, param = name.partition("[")
        assert base in tests, f"tests/_tiers.py lists {name}, which does not exist: drop or rename it"
        if param:
            assert any(d.func.attr == "parametrize" for d in tests[base].decorator_list
                       if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)), name
        assert why and covers, f"{name}: say why it is extended and which CI-tier tests cover its parts"
        for cover in covers:
            assert cover in tests, f"{name}: its cover {cover} does not exist"
            assert extended_id(cover) is None, f"{name}: its cover {cover} is extended itself"
    this = Path(__file__).relative_to(ROOT).as_posix()
    marked = [rel for rel, (text, _) in _test_modules().items() if rel != this and "mark." + "extended" in text]
    assert not marked, f"mark a test extended in tests/_tiers.py (with its reason), not in {marked}"


def test_readme_and_ci_run_the_tier_and_build_notes_give_the_full_suite():
    readme = (ROOT / "README.md").read_text().splitlines()
    command = "python -m pytest -q -n auto --maxprocesses 4 --dist loadfile -m \"not extended\" tests"
    assert command in readme[3], "README's second command is the CI tier"
    assert command in (ROOT / ".ci" / "run").read_text()
    full = command.replace(' -m "not extended"', "")
    assert full in (ROOT / "BUILD_NOTES.md").read_text()
