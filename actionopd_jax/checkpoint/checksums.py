"""A checksum manifest per checkpoint step: `<step>/checksums.json` holds the SHA-256 and size
of every file Orbax wrote for the step, so a flipped bit or a truncated file is found before the
step is restored (Orbax reads damaged data without complaint when the damage falls inside an
array's bytes).

The manifest is written once the step's save has finished (the step folder is final) and
is verified per item before a restore reads it. Steps written before manifests existed have
none: they load unverified, with a note saying so.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "checksums.json"
VERSION = 1
_CHUNK = 1 << 22


class ChecksumMismatch(ValueError):
    """A step's files do not match its manifest (the message names them)."""


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(step_dir: str | Path) -> Path:
    """Record every file of a finished step; returns the manifest's path."""
    step_dir = Path(step_dir)
    files = {str(p.relative_to(step_dir)): {"sha256": _digest(p), "bytes": p.stat().st_size}
             for p in _files(step_dir)}
    out = step_dir / MANIFEST
    tmp = out.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"version": VERSION, "files": files}, indent=1, sort_keys=True))
    tmp.replace(out)  # a crash mid-write leaves no half manifest
    return out


def has_manifest(step_dir: str | Path) -> bool:
    return (Path(step_dir) / MANIFEST).is_file()


def verify(step_dir: str | Path, items: tuple[str, ...]) -> bool:
    """Check the files of `items` (sub-folders such as "params", "meta") against the manifest.
    False when the step has no manifest (unverified); raises ChecksumMismatch naming the files
    that are missing, changed or unreadable."""
    step_dir = Path(step_dir)
    if not has_manifest(step_dir):
        return False
    try:
        recorded = json.loads((step_dir / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ChecksumMismatch(f"its checksum manifest {step_dir / MANIFEST} is unreadable ({e})") from e
    bad = []
    for rel, want in sorted(recorded.items()):
        if rel.split("/", 1)[0] not in items:
            continue
        p = step_dir / rel
        if not p.is_file():
            bad.append(f"{rel} is missing")
        elif p.stat().st_size != want["bytes"]:
            bad.append(f"{rel} has {p.stat().st_size} bytes, {want['bytes']} were written")
        elif _digest(p) != want["sha256"]:
            bad.append(f"{rel} does not match its checksum")
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ChecksumMismatch(f"its files differ from what was saved: {'; '.join(bad[:3])}{more}")
    return True
