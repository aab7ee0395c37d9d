"""Files and directories that are either complete or absent: write to a temporary sibling, then rename."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new or renamed files) durable where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _default_permissions(path: Path) -> None:
    """Give ``path`` (and everything under a directory) the permissions a plain create would:
    temporary files and directories are created private (0600 / 0700)."""
    mask = _umask()
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


@contextmanager
def atomic_directory(target: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``target``; on success it is renamed to ``target``.

    An exception removes the temporary directory and leaves ``target`` as it was; a crash leaves at
    most a hidden ``.<name>.tmp-*`` sibling. An existing ``target`` is an error unless ``overwrite``.
    """
    target = Path(target)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass --overwrite (overwrite=True) to replace it, or choose a new directory")
    if not target.exists() and target.is_symlink():
        raise FileExistsError(f"{target} is a dangling symlink; remove it first")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    old: Path | None = None
    try:
        yield tmp
        _default_permissions(tmp)
        fsync_dir(tmp)
        if target.exists():
            old = parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            target.rename(old)
        try:
            tmp.rename(target)
        except BaseException:
            if old is not None:
                old.rename(target)
                old = None
            raise
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
        _default_permissions(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``path.write_text(text)``, atomically."""
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def append_whole(path: str | Path, data: bytes) -> None:
    """Append ``data`` (e.g. one JSONL line) to ``path`` whole or not at all: one ``os.write`` on an
    ``O_APPEND`` descriptor; a short or failed write (a full disk) is cut back to the file's previous
    length and raised as ``OSError`` naming the file, so a record is never left cut in the middle."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        before = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
        except OSError as err:
            _cut_back(fd, before)
            raise OSError(err.errno, err.strerror, os.fspath(path)) from err
        if written != len(data):
            _cut_back(fd, before)
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (wrote {written} of {len(data)} bytes)",
                          os.fspath(path))
    finally:
        os.close(fd)


def _cut_back(fd: int, length: int) -> None:
    """Truncate a file to ``length`` after a partial append (best effort: truncating frees space)."""
    try:
        os.ftruncate(fd, length)
    except OSError:
        pass


def save_figure_atomic(fig, path: str | Path, dpi: int = 100) -> Path:
    """``fig.savefig(path)``, atomically (the temporary name keeps the suffix, so the format is kept)."""
    return write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi))
