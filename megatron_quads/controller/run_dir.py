"""The run directory's rules: one run at a time, a resume continues the saved config, and nothing a
user may want (records, configs) is deleted or truncated; earlier files are moved aside instead.

Standard library only at import time (the lock, taken before anything heavy starts, imports ``filelock``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatron_quads.atomic_io import write_text_atomic
from megatron_quads.controller.faults import STORAGE_FIXES
from megatron_quads.manifest import MANIFEST, read_manifest, sha256

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
RECORD_FILES = ("metrics.jsonl", "eval.jsonl", "samples.jsonl")
CONFIG_NAME = "config.yaml"
"""The resolved run config, in the run directory and in each checkpoint (the config that made it)."""
_STEP = re.compile(r"step_(\d+)")

RESUMABLE_KEYS: tuple[str, ...] = (
    "run_dir",                                 # where the run is, not what it computes (a moved or respelled path)
    "model.hf_cache_dir",                      # where model.hf_path's conversion is kept, not what it holds
    "grpo.steps",                              # how far the run goes: extend or shorten it
    "logging",                                 # where the metrics also go (wandb mode, project)
    "profile",                                 # which steps are profiled: recording changes no value
    "eval",                                    # evaluation reads the weights, never changes them or the prompt stream
    "checkpoint.every",                        # saving reads the state, never changes it
    "checkpoint.keep_last",
    "checkpoint.preemption_grace_s",           # how a stop on SIGTERM / SIGINT is handled
    "rollout.timeout_s",                       # failure handling: when an engine counts as hung, how often to retry
    "rollout.max_retries",
    "rollout.sync_bucket_mb",                  # the weight sync's buffer size: the same values arrive
    "rollout.vllm.gpu_memory_utilization",     # memory of the engine (e.g. after an out-of-memory stop)
    "rollout.vllm.cpu_kv_cache_gb",
    "rollout.vllm.gpu_kv_cache_gb",
    "placement.ray_address",                   # which Ray cluster: a restarted job may get another one
    "placement.strategy",                      # how the bundles spread over the nodes
)
"""Dotted config keys (and the sections under them) a resume may change: they say how the run is
operated or observed, not what it computes, so the resumed run still continues the saved one. Any
other difference from the saved ``config.yaml`` is refused (``force_config`` overrides)."""


class RunDirError(RuntimeError):
    """The run directory cannot take this run (in use by another run, or holding another run)."""


class RunDirBusy(RunDirError):
    """Another process holds the run directory's lock."""


class ConfigMismatch(RunDirError):
    """The config differs from the saved one of the run the directory holds in keys a resume may not change."""


class RunDirUnusable(RunDirError):
    """The run directory cannot be created or written (a file where a directory belongs, a read-only
    filesystem, no permission)."""


def _unusable(path: Path, err: OSError, doing: str) -> RunDirUnusable:
    name = errno.errorcode.get(err.errno, str(err.errno))
    fix = STORAGE_FIXES.get(err.errno, "fix the storage, or choose another run_dir (run_dir=...)")
    return RunDirUnusable(f"run_dir: cannot {doing} {path}: {err.strerror or err} ({name}); {fix}")


def prepare_run_dir(run_dir: str | Path) -> None:
    """Create ``run_dir`` and check this process can write in it (and in its ``checkpoints/``) before
    anything heavy starts. A file where one of those directories (or a parent) belongs, a read-only
    filesystem, a missing permission or a record file that is not a writable regular file raises
    :class:`RunDirUnusable`, one line naming the path, the cause and the fix."""
    run_dir = Path(run_dir)
    for path in (run_dir / "checkpoints", run_dir, *run_dir.parents):
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                raise RunDirUnusable(f"run_dir: {path} is a file where the run needs a directory; move the file "
                                     "away, or choose another run_dir (run_dir=...)")
            break
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _unusable(Path(err.filename or run_dir), err, "create") from None
    for directory in (run_dir, run_dir / "checkpoints"):
        if not directory.is_dir():
            continue
        try:  # a probe file: write permission and a writable filesystem (os.access misses both for root)
            fd, name = tempfile.mkstemp(prefix=".write-test-", dir=directory)
            os.close(fd)
            os.unlink(name)
        except OSError as err:
            raise _unusable(directory, err, "write in") from None
    for name in (*RECORD_FILES, LOCK_NAME):
        path = run_dir / name
        if path.exists() and not path.is_file():
            raise RunDirUnusable(f"run_dir: {path} is not a regular file (the run appends to it); move it away, "
                                 "or choose another run_dir (run_dir=...)")
        if path.is_file() and not os.access(path, os.W_OK):
            raise RunDirUnusable(f"run_dir: cannot write {path}: Permission denied (EACCES); "
                                 f"{STORAGE_FIXES[errno.EACCES]}")


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """The run's step checkpoints with a manifest (``checkpoints/step_N/manifest.json``), oldest first;
    a directory still being written (no manifest yet) and any other name are left out."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if (m := _STEP.fullmatch(p.name)) and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def make_way_for_checkpoint(path: Path) -> None:
    """Clear ``checkpoints/step_N`` for a new save: a directory there (an unfinished or damaged save
    of this run) is removed; anything else (a stray file, a link) is moved aside to
    ``step_N.stray-<UTC time>`` with a warning, so no save fails on it and nothing is deleted."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target, n = path.with_name(f"{path.name}.stray-{stamp}"), 0
        while target.exists() or target.is_symlink():
            n += 1
            target = path.with_name(f"{path.name}.stray-{stamp}-{n}")
        path.rename(target)
        logger.warning("%s was not a checkpoint directory (a stray file where this run saves step %s): moved it to %s",
                       path, path.name.removeprefix("step_"), target)


def checkpoint_config(checkpoint: Path) -> dict | None:
    """The run config a checkpoint records (its ``config.yaml``, the resolved config of the run that
    saved it), or None for a checkpoint that records none. A ``config.yaml`` that does not match the
    sha256 its manifest lists, or does not parse as a mapping, raises ``ValueError`` naming it."""
    import yaml

    path = checkpoint / CONFIG_NAME
    files = read_manifest(checkpoint).get("files")
    listed = files.get(CONFIG_NAME) if isinstance(files, dict) else None
    if listed is None and not path.is_file():
        return None
    if listed is not None and (not path.is_file() or sha256(path) != listed.get("sha256")):
        raise ValueError(f"{path} is missing or does not match its sha256 in {MANIFEST}")
    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"{path} cannot be read: {err}") from None
    if not isinstance(tree, dict):
        raise ValueError(f"{path} is not a mapping")
    return tree


def newest_checkpoint_config(run_dir: str | Path) -> tuple[Path, dict] | None:
    """The config of the newest checkpoint that records one (``(its config.yaml, the tree)``), the one
    a resume starts from unless the checkpoint turns out damaged; a checkpoint whose config is damaged
    or whose manifest does not mark it complete is skipped, as the resume skips it."""
    for checkpoint in reversed(checkpoint_dirs(run_dir)):
        try:
            if read_manifest(checkpoint).get("complete") is not True:
                continue
            tree = checkpoint_config(checkpoint)
        except (OSError, ValueError) as err:
            logger.warning("checkpoint %s: its config cannot be checked (%s); the resume skips it", checkpoint, err)
            continue
        if tree is not None:
            return checkpoint / CONFIG_NAME, tree
    return None


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _holder(path: Path) -> str:
    """The lock file's holder as ``pid N@host since T`` (or a note when it is not written yet)."""
    try:
        info = json.loads(path.read_text() or "null")
        return f"pid {info['pid']}@{info['host']} since {info['since']}"
    except (OSError, ValueError, TypeError, KeyError):
        return "a process that has not recorded itself yet"


def _record_holder(path: Path) -> Callable[[int], None]:
    """``on_acquired`` for the lock: write this process (pid, host, start time) into the locked file."""

    def record(fd: int) -> None:
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": _utc()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except OSError as err:  # a full disk: name the file
            raise OSError(err.errno, err.strerror, str(path)) from err

    return record


@contextmanager
def hold_run_dir(run_dir: str | Path) -> Iterator[None]:
    """Hold ``run_dir/.lock`` exclusively (``filelock.FileLock``: ``flock``, non-blocking) for the
    ``with`` block; the file names the holder (pid, host, start time). A second holder is refused at
    once with :class:`RunDirBusy` naming the first. The lock ends with the block or with the process
    (the kernel drops it; on NFS the server's lease does); the file stays, emptied."""
    from filelock import FileLock, Timeout

    run_dir = Path(run_dir)
    path = run_dir / LOCK_NAME
    lock = FileLock(path, blocking=False, mode=0o644, on_acquired=_record_holder(path))
    try:
        lock.acquire()
        locked = True
    except Timeout:
        raise RunDirBusy(
            f"run_dir {run_dir} is in use by another run: {_holder(path)} (lock {path}). Wait for that run to end "
            f"or stop it, or give this run another directory (run_dir=...)") from None
    except OSError as err:
        if err.errno not in (errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        # a filesystem without flock (e.g. Lustre mounted without -o flock)
        logger.warning("cannot lock %s (%s): this filesystem has no flock, so nothing keeps a second run out "
                       "of %s; run one at a time there", path, err, run_dir)
        locked = False
    try:
        yield
    finally:
        if locked:
            try:
                os.truncate(path, 0)
            finally:
                lock.release()


_ABSENT = "(absent)"


def config_differences(saved: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Every leaf where two config trees differ, as (dotted key, saved value, new value); a key on
    one side only has the value ``'(absent)'`` on the other."""
    if isinstance(saved, dict) and isinstance(new, dict):
        keys = [*new, *(k for k in saved if k not in new)]
        return [d for k in keys for d in config_differences(saved.get(k, _ABSENT), new.get(k, _ABSENT), f"{prefix}{k}.")]
    return [] if saved == new else [(prefix[:-1], saved, new)]


def may_change_on_resume(key: str) -> bool:
    """Whether ``key`` is one of :data:`RESUMABLE_KEYS` or lies under one."""
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)


def refused_differences(saved: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """The differences of ``new`` from ``saved`` a resume may not make (outside :data:`RESUMABLE_KEYS`)."""
    return [d for d in config_differences(saved, new) if not may_change_on_resume(d[0])]


def mismatch_message(run_dir: Path, refused: list[tuple[str, Any, Any]], source: Path | None = None) -> str:
    """One line: the saved config ``source`` (default: ``run_dir/config.yaml``), each key that differs
    with its saved and new value, and the three ways on."""
    source = source or run_dir / CONFIG_NAME
    changes = ", ".join(f"{key}: {old!r} (saved) -> {new!r} (now)" for key, old, new in refused)
    return (f"run_dir {run_dir} holds an earlier run whose config ({source}) differs from this config in keys a "
            f"resume may not change: {changes}. To continue that run, resume with its config: megatron-quads train "
            f"{source} (overrides of {', '.join(RESUMABLE_KEYS)} may be added); to run this config, give it a new "
            "run_dir (run_dir=...); to continue the run under this config anyway, pass --force-config "
            "(run(cfg, force_config=True)), which keeps the saved config.yaml as config.<time>.yaml.")


def has_records(run_dir: Path) -> bool:
    """Whether any record file (:data:`RECORD_FILES`) in ``run_dir`` holds anything."""
    return any((run_dir / name).is_file() and (run_dir / name).stat().st_size > 0 for name in RECORD_FILES)


def _read_saved_config(path: Path, run_dir: Path, force: bool) -> dict | None:
    """``run_dir/config.yaml`` as a tree; an unreadable one is a :class:`ConfigMismatch` (None with ``force``)."""
    import yaml

    try:
        saved = yaml.safe_load(path.read_text())
        if not isinstance(saved, dict):
            raise ValueError("not a mapping")
    except (OSError, ValueError, yaml.YAMLError) as err:
        if not force:
            raise ConfigMismatch(f"run_dir {run_dir} holds an earlier run but its {path} is unreadable ({err}): "
                                 "repair it, give this run a new run_dir (run_dir=...), or pass --force-config "
                                 "to continue the run under this config") from None
        return None
    return saved


def check_saved_config(run_dir: Path, new: dict, *, has_checkpoint: bool, force: bool = False,
                       normalize: Callable[[dict], dict] = lambda tree: tree,
                       recorded: tuple[Path, dict] | None = None) -> None:
    """When ``run_dir`` holds an earlier run (a checkpoint or records), refuse ``new`` (a resolved config
    tree) if it differs outside :data:`RESUMABLE_KEYS` from the saved config, with
    :class:`ConfigMismatch` listing each difference on one line. The saved config is the one the
    newest checkpoint records (``recorded``: its ``config.yaml`` and tree, see
    :func:`newest_checkpoint_config`), whether or not ``run_dir/config.yaml`` is still there; without
    one, ``run_dir/config.yaml``. With ``force`` the run goes on and ``run_dir/config.yaml`` is moved
    aside (``config.<time>.yaml``). ``normalize`` fills a saved tree's defaults."""
    path = run_dir / CONFIG_NAME
    if not (has_checkpoint or has_records(run_dir)):
        return
    if recorded is not None:
        source, saved = recorded
    elif path.is_file():
        source, saved = path, _read_saved_config(path, run_dir, force)
    else:
        if has_checkpoint:
            logger.warning("run_dir %s holds checkpoints that record no config and has no config.yaml: this config "
                           "cannot be checked against the run that made them", run_dir)
        return
    refused = refused_differences(normalize(saved), new) if saved is not None else [(CONFIG_NAME, "unreadable", "-")]
    if not refused:
        return
    if not force:
        raise ConfigMismatch(mismatch_message(run_dir, refused, source))
    aside = move_aside(path)
    logger.warning("--force-config: %s continues under a config that differs from %s in %s%s", run_dir, source,
                   ", ".join(key for key, _, _ in refused), f"; the saved config is now {aside}" if aside else "")


def move_aside(path: Path, stamp: str | None = None) -> Path | None:
    """Rename ``path`` (when it has content) to ``<stem>.<UTC time><suffix>`` beside it, with ``-1``,
    ``-2``, ... added rather than overwrite a file; returns the new path (None: nothing to move).
    Called under the run directory's lock, so no other run takes the name meanwhile."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    stamp = stamp or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
    n = 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.stem}.{stamp}-{n}{path.suffix}")
    path.rename(target)
    return target


def start_records(path: Path, stamp: str | None = None) -> None:
    """A fresh run's empty record file; an earlier one with content is moved aside (warned)."""
    aside = move_aside(path, stamp)
    if aside is not None:
        logger.warning("a fresh run in %s: the earlier %s is now %s", path.parent, path.name, aside)
    path.write_text("")


def keep_records_before(path: Path, start: int, stamp: str | None = None) -> None:
    """A resume at step ``start`` keeps the records of steps < ``start`` (the steps it does again
    are recorded anew); when that drops any line (also an unreadable one, from a run that stopped
    mid-write), the whole original is moved aside first (warned)."""
    lines = path.read_text().splitlines() if path.is_file() else []
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] < start:
                kept.append(line)
        except (ValueError, TypeError, KeyError):
            pass
    if len(kept) < len(lines):
        aside = move_aside(path, stamp)
        logger.warning("resuming at step %d: %s keeps the records of steps < %d; the original (%d records) is now %s",
                       start, path, start, len(lines), aside)
    write_text_atomic(path, "".join(line + "\n" for line in kept))
