"""``manifest.json``: every file of a checkpoint directory with its size and sha256, and how it was made."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_quads.atomic_io import write_text_atomic

MANIFEST = "manifest.json"


def sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() != MANIFEST)


def write_manifest(directory: str | os.PathLike[str], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Record every file under ``directory`` (``bytes``, ``sha256``) plus ``extra`` in ``directory/manifest.json``."""
    root = Path(directory)
    files = {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in _files(root)}
    doc = {"files": files, **(extra or {})}
    write_text_atomic(root / MANIFEST, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def verify_manifest(directory: str | os.PathLike[str], regenerate: str = "re-create the directory") -> dict[str, Any]:
    """Check every file listed in ``directory/manifest.json``; returns the manifest or raises naming the bad file.

    ``regenerate`` is the fix the error messages suggest.
    """
    root = Path(directory)
    path = root / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{root} has no {MANIFEST}: {regenerate}")
    doc = json.loads(path.read_text())
    for name, entry in doc["files"].items():
        file = root / name
        if not file.is_file():
            raise FileNotFoundError(f"{file} is listed in {MANIFEST} but missing: {regenerate}")
        if file.stat().st_size != entry["bytes"] or sha256(file) != entry["sha256"]:
            raise ValueError(f"{file} does not match its size / sha256 in {MANIFEST}: {regenerate}")
    return doc
