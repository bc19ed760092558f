"""The repository refers to nothing outside itself.

Two checks over the tracked files (git ls-files), text only, well under a second:
- no absolute path of one machine (a home or work folder, a sibling `shared/` checkout, a
  peer benchmark harness next to the repository);
- every `docs/...` or `notes/...` file that a .py or .md file names exists in the
  repository, and so does every `configs/`, `benchmarks/`, `tools/`, `launch/` or `tests/` file
  that a .md file names (globs such as `configs/paper/qwen3_*.yaml` must match one), and
  every upper-case top-level document (`BUILD_NOTES.md`-style) named anywhere.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SELF = "tests/test_repo_references.py"

# spelled in pieces so that this file does not match itself
MACHINE_PATHS = ["/" + "work/", "/" + "root/", "/" + "home/", ".." + "/shared", "shared/" + "peer_bench",
                 "/tmp/" + "peer_"]

TEXT_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg", ".json", ".jsonl")
REF = re.compile(r"(?<![\w./-])((?:docs|notes|configs|benchmarks|tools|launch|tests)/[\w./*-]*[\w*])")
TOP_DOC = re.compile(r"(?<![\w./-])([A-Z][A-Z_]+\.md)\b")


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return out.split()
    except (OSError, subprocess.CalledProcessError):
        # not a git checkout (an unpacked sdist): every file below the root except caches
        found = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"
                           and not d.endswith(".egg-info")]
            found += [str(Path(dirpath, f).relative_to(ROOT)) for f in filenames]
        return found


FILES = _tracked()
TRACKED = set(FILES)
DIRS = {"/".join(f.split("/")[:i]) for f in FILES for i in range(1, f.count("/") + 1)}


def _texts(suffixes):
    for f in FILES:
        if f == SELF or not (f.endswith(suffixes) or f.startswith(".ci/")):
            continue
        path = ROOT / f
        if path.is_file() and path.stat().st_size < 2_000_000:
            yield f, path.read_text(errors="replace")


def _exists(ref: str) -> bool:
    ref = ref.rstrip(".")
    if "*" in ref:
        return any(fnmatch.fnmatch(f, ref) for f in FILES)
    return ref in TRACKED or ref in DIRS


def test_no_machine_paths():
    hits = [f"{f}:{t.count(chr(10), 0, t.find(p)) + 1}: {p}" for f, t in _texts(TEXT_SUFFIXES)
            for p in MACHINE_PATHS if p in t]
    assert not hits, ("absolute paths of one machine in the repository (say what the reader needs, or make "
                      "it an option):\n" + "\n".join(hits))


def test_named_repository_files_exist():
    missing = []
    for f, text in _texts((".py", ".md")):
        for m in REF.finditer(text):
            ref = m.group(1)
            # outside docs/ and notes/ only names with a suffix or a glob are paths: `tools/list`
            # is an MCP method
            last = ref.rsplit("/", 1)[1]
            checked = ref.startswith(("docs/", "notes/")) or (f.endswith(".md") and ("." in last or "*" in last))
            if checked and not _exists(ref):
                missing.append(f"{f}:{text.count(chr(10), 0, m.start()) + 1}: {ref}")
        for m in TOP_DOC.finditer(text):
            if m.group(1) not in TRACKED and f"docs/{m.group(1)}" not in TRACKED:
                missing.append(f"{f}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}")
    assert not missing, "files named but not in the repository:\n" + "\n".join(missing)


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The patterns themselves: a machine path and a missing docs file are found."""
    text = "see " + "/" + "home/u/x and docs/absent_file.md and docs/formats.md."
    assert any(p in text for p in MACHINE_PATHS)
    refs = [m.group(1) for m in REF.finditer(text)]
    assert refs == ["docs/absent_file.md", "docs/formats.md"]
    assert [_exists(r) for r in refs] == [False, True]
    assert _exists("configs/paper/qwen3_*.yaml") and not _exists("configs/paper/qwen9_*.yaml")


def test_ci_turns_the_lowering_skips_into_failures(monkeypatch):
    """.ci/run exports the variables of tests/_required.py, and with them a missing CUDA plugin
    or libtpu fails the lowering tests instead of skipping them."""
    import pytest

    from tests._required import REQUIRE_CUDA, REQUIRE_TPU, skip_or_fail

    ci = (ROOT / ".ci" / "run").read_text()
    assert f"{REQUIRE_CUDA}=1" in ci and f"{REQUIRE_TPU}=1" in ci
    monkeypatch.delenv(REQUIRE_CUDA, raising=False)
    with pytest.raises(pytest.skip.Exception):
        skip_or_fail(REQUIRE_CUDA, "no plugin")
    monkeypatch.setenv(REQUIRE_CUDA, "1")
    with pytest.raises(pytest.fail.Exception, match="no plugin.*ACTIONOPD_REQUIRE_CUDA_LOWERING is set"):
        skip_or_fail(REQUIRE_CUDA, "no plugin")
