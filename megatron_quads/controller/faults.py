"""Storage faults in a run: an ``OSError`` from a full disk, a missing permission, a read-only
filesystem or a file where a directory belongs becomes a :class:`StorageError` that names the path,
the cause and the fix; Megatron's checkpoint-write wrapper is unwrapped to the rank's own error.

Standard library only: the command line reports run-directory faults before anything heavy loads.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

STORAGE_FIXES: dict[int, str] = {
    errno.ENOSPC: "free space on that filesystem",
    errno.EDQUOT: "free space or raise the disk quota",
    errno.EFBIG: "the file outgrew a size limit (ulimit -f or the filesystem's): lift it or use other storage",
    errno.EROFS: "the filesystem is mounted read-only: remount it read-write or choose a run_dir elsewhere",
    errno.EACCES: "give this user write permission there, or choose another run_dir",
    errno.EPERM: "give this user write permission there, or choose another run_dir",
    errno.ENOTDIR: "a file stands where a directory belongs: move the file away, or choose another run_dir",
    errno.EISDIR: "a directory stands where a file belongs: move it away, or choose another run_dir",
    errno.EIO: "the storage reported an I/O error: check the device or the network filesystem",
}
"""Errnos that are faults of the storage (not of the program or its inputs), with the fix for each."""

WRITE_FAULTS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
"""Errnos only a write meets; the others (permissions, a file where a directory belongs, I/O errors)
also come from reading a user's inputs, and from calls on no file at all (``os.kill``, sockets)."""

_TEMPORARY = re.compile(r"^\.(?P<stem>.+)\.[A-Za-z0-9_]{8}\.tmp(?P<suffix>\..*)?$")  # atomic_io's temporary names


class StorageError(OSError):
    """A read or write under the run directory failed for a reason of the storage; the message names
    what was being written, the path, the cause and the fix. ``errno`` and ``filename`` are the
    original error's."""

    def __init__(self, message: str, code: int | None = None, filename: str | None = None) -> None:
        super().__init__(message)
        self.errno, self.filename, self.message = code, filename, message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return type(self), (self.message, self.errno, self.filename)

    def with_note(self, note: str) -> StorageError:
        """The same fault with ``note`` (what to do next) on a line of its own."""
        return StorageError(f"{self.message}\n{note}", self.errno, self.filename)


def is_storage_fault(err: BaseException, within: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``err`` is an ``OSError`` the storage caused (:data:`STORAGE_FIXES`): a write fault
    (:data:`WRITE_FAULTS`) anywhere, any other only on a path under ``within`` (the run directory;
    on any named path when ``within`` is None)."""
    code = getattr(err, "errno", None)
    if not isinstance(err, OSError) or code not in STORAGE_FIXES:
        return False
    if code in WRITE_FAULTS:
        return True
    filename = getattr(err, "filename", None)
    if filename is None or isinstance(filename, int):
        return False
    if within is None:
        return True
    path, root = Path(os.path.abspath(os.fsdecode(filename))), Path(os.path.abspath(within))
    return path == root or root in path.parents


def _what(path: Path) -> str:
    """What a file of a run is, for a reader ("the metrics record", "the checkpoint of step 8")."""
    parts = path.parts
    for i, part in enumerate(parts[:-1]):
        if part == "checkpoints" and re.fullmatch(r"step_\d+", parts[i + 1]):
            return f"the checkpoint of step {parts[i + 1].removeprefix('step_')}"
    return {"metrics.jsonl": "the metrics record", "eval.jsonl": "the evaluation record", ".lock": "the run_dir lock",
            "config.yaml": "the run config", "placement.json": "the placement record", "metrics.png": "the plot",
            "checkpoints": "the checkpoints directory"}.get(path.name, "a file of the run")


def storage_error(err: OSError, what: str | None = None) -> StorageError:
    """``err`` (a storage fault, :func:`is_storage_fault`) as one line: what was written (``what``, or
    told by the path), the path (an atomic write's temporary file by the file it replaces), the cause
    and the fix."""
    filename = getattr(err, "filename", None)
    path = Path(os.fsdecode(filename)) if filename is not None else None
    match = _TEMPORARY.match(path.name) if path is not None else None
    if match:
        path = path.with_name(match["stem"] + (match["suffix"] or ""))
    what = what or (_what(path) if path is not None else "a file of the run")
    where = f" {path}" if path is not None else ""
    name = errno.errorcode.get(err.errno, str(err.errno))
    verb = "write" if err.errno in WRITE_FAULTS else "access"
    return StorageError(f"cannot {verb} {what}{where}: {err.strerror or err} ({name}); {STORAGE_FIXES[err.errno]}",
                        err.errno, None if path is None else str(path))


def checkpoint_write_error(err: BaseException) -> BaseException:
    """The error behind a failed dist-checkpoint write. torch's ``CheckpointException`` (a
    ``BaseException`` whose text starts ``CheckpointException ranks:dict_keys([0])``) holds each
    failed rank's exception, and Megatron's writer wraps a writer process's error in
    ``RuntimeError('Worker failure: ...')``; the first rank's ``OSError`` is returned (its errno and
    file kept, also when only its text crossed a process), else a ``RuntimeError`` with the first
    rank's error. Any other error is returned as it is."""
    failures = getattr(err, "failures", None)
    if type(err).__name__ != "CheckpointException" or not isinstance(failures, dict) or not failures:
        return err
    rank = min(failures)
    cause = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    if not isinstance(cause, BaseException):
        return err
    return _os_error(cause) or RuntimeError(f"writing the dist checkpoint failed on rank {rank}: "
                                            f"{type(cause).__name__}: {cause}")


_OS_ERROR_TEXT = re.compile(r"\[Errno (?P<code>\d+)\] (?P<strerror>[^:\n]+)(?:: '(?P<filename>[^'\n]+)')?")


def _os_error(err: BaseException) -> OSError | None:
    """The ``OSError`` in ``err``'s chain of causes, or one rebuilt from the ``[Errno N] text: 'file'``
    a message of the chain carries (a cause does not survive pickling between processes)."""
    chain: list[BaseException] = []
    while err is not None and all(err is not e for e in chain):
        chain.append(err)
        err = err.__cause__ or err.__context__
    for link in chain:
        if isinstance(link, OSError) and link.errno is not None:
            return link
    for link in chain:
        match = _OS_ERROR_TEXT.search(str(link))
        if match:
            return OSError(int(match["code"]), match["strerror"], match["filename"])
    return None
