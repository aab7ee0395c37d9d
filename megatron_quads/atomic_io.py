"""Files that are either complete or absent: write to a temporary sibling, then rename."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it over ``path``.

    A crash leaves the previous ``path`` (or none) and at most a ``.tmp`` sibling, never half a file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp" + path.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``path.write_text(text)``, atomically."""
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def save_figure_atomic(fig, path: str | Path, dpi: int = 100) -> Path:
    """``fig.savefig(path)``, atomically (the temporary name keeps the suffix, so the format is kept)."""
    return write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi))
