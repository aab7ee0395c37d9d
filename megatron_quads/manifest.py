"""``manifest.json``: every file of a checkpoint directory with its size and sha256, and how it was made."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from megatron_quads.atomic_io import write_text_atomic

MANIFEST = "manifest.json"


def sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() != MANIFEST)


def _sha256_all(paths: list[Path]) -> list[str]:
    """sha256 of each file, a few at a time (hashlib releases the GIL: large checkpoints hash in parallel)."""
    if len(paths) <= 1:
        return [sha256(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256, paths))


def write_manifest(directory: str | os.PathLike[str], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Record every file under ``directory`` (``bytes``, ``sha256``) plus ``extra`` in ``directory/manifest.json``."""
    root = Path(directory)
    paths = _files(root)
    files = {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "sha256": digest}
             for p, digest in zip(paths, _sha256_all(paths), strict=True)}
    doc = {"files": files, **(extra or {})}
    write_text_atomic(root / MANIFEST, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def read_manifest(directory: str | os.PathLike[str], regenerate: str = "re-create the directory") -> dict[str, Any]:
    """``directory/manifest.json`` as a dict; a missing or unparsable one raises naming it."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{Path(directory)} has no {MANIFEST}: {regenerate}")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} cannot be read ({err}): {regenerate}") from err
    if not isinstance(doc, dict):
        raise ValueError(f"{path} is not a JSON object: {regenerate}")
    return doc


def verify_manifest(directory: str | os.PathLike[str], regenerate: str = "re-create the directory") -> dict[str, Any]:
    """Check every file listed in ``directory/manifest.json``; returns the manifest or raises naming the bad file.

    A file is good when it exists with the listed size and sha256 (sizes are checked first, for every
    file, so a missing or truncated file is found without hashing). ``regenerate`` is the fix the
    error messages suggest.
    """
    root = Path(directory)
    doc = read_manifest(root, regenerate)
    files = doc.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"{root / MANIFEST} lists no files (no 'files' object), so nothing can be verified: {regenerate}")
    for name, entry in files.items():
        file = root / name
        if not file.is_file():
            raise FileNotFoundError(f"{file} is listed in {MANIFEST} but missing: {regenerate}")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise ValueError(f"{file} has {size} bytes but {MANIFEST} lists {entry['bytes']} (truncated or "
                             f"overwritten): {regenerate}")
    names = list(files)
    for name, digest in zip(names, _sha256_all([root / n for n in names]), strict=True):
        if digest != files[name]["sha256"]:
            raise ValueError(f"{root / name} does not match its sha256 in {MANIFEST} (its bytes changed): {regenerate}")
    return doc
