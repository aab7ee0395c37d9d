"""Storage faults (a full disk, a missing permission, a read-only filesystem) told by path, cause and
fix: the translation rules and the dist-checkpoint unwrapping."""

from __future__ import annotations

import errno
import pickle
import traceback
from pathlib import Path

from megatron_quads.controller.faults import checkpoint_write_error, is_storage_fault, storage_error


def test_a_storage_fault_names_what_was_written_the_path_the_cause_and_the_fix() -> None:
    shard = "/r/checkpoints/step_8/trainer.partial/__0_0.distcp"
    assert str(storage_error(OSError(errno.ENOSPC, "No space left on device", shard))) == (
        f"cannot write the checkpoint of step 8 {shard}: No space left on device (ENOSPC); free space on that "
        "filesystem")
    temporary = "/r/.config.k2j4_x9a.tmp.yaml"  # atomic_io's temporary file: named by the file it replaces
    assert str(storage_error(OSError(errno.EROFS, "Read-only file system", temporary))).startswith(
        "cannot write the run config /r/config.yaml: Read-only file system (EROFS); the filesystem is mounted "
        "read-only")
    assert str(storage_error(OSError(errno.EACCES, "Permission denied", "/r/metrics.jsonl"))) == (
        "cannot access the metrics record /r/metrics.jsonl: Permission denied (EACCES); give this user write "
        "permission there, or choose another run_dir")
    fault = storage_error(OSError(errno.EDQUOT, "Disk quota exceeded", "/r/.lock"))
    assert (fault.errno, fault.filename) == (errno.EDQUOT, "/r/.lock")
    assert pickle.loads(pickle.dumps(fault)).message == fault.message  # crosses Ray's process boundary whole


def test_which_errors_are_storage_faults(tmp_path: Path) -> None:
    assert is_storage_fault(OSError(errno.ENOSPC, "No space left on device"))  # a write fault needs no path
    assert not is_storage_fault(PermissionError(errno.EPERM, "Operation not permitted"))  # os.kill, not storage
    assert is_storage_fault(PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "metrics.jsonl")),
                            within=tmp_path)
    assert not is_storage_fault(PermissionError(errno.EACCES, "Permission denied", "/data/model/metadata.json"),
                                within=tmp_path)  # a user's input: not the run's storage
    assert not is_storage_fault(FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "x")))
    assert not is_storage_fault(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    assert not is_storage_fault(ValueError("no"))


def test_a_failed_dist_checkpoint_write_is_unwrapped_to_the_rank_s_os_error() -> None:
    from torch.distributed.checkpoint import CheckpointException

    cause = OSError(errno.ENOSPC, "No space left on device", "/r/checkpoints/step_2/trainer.partial/__0_0.distcp")
    try:  # how Megatron's writer reports its writer process's error
        raise RuntimeError(f"Worker failure: {cause}") from cause
    except RuntimeError as wrapped:
        worker_failure = wrapped
    hidden = CheckpointException("write", {0: (worker_failure, traceback.StackSummary())})
    assert str(hidden).startswith("CheckpointException ranks:dict_keys([0])")  # the text a user saw
    assert checkpoint_write_error(hidden) is cause
    sent = pickle.loads(pickle.dumps(worker_failure))  # from another rank: only the text survives
    assert sent.__cause__ is None
    rebuilt = checkpoint_write_error(CheckpointException("write", {1: (sent, traceback.StackSummary())}))
    assert (rebuilt.errno, rebuilt.strerror, rebuilt.filename) == (cause.errno, cause.strerror, cause.filename)
    other = checkpoint_write_error(CheckpointException("write", {3: (ValueError("bad shape"), None)}))
    assert str(other) == "writing the dist checkpoint failed on rank 3: ValueError: bad shape"
    plain = ValueError("not a checkpoint error")
    assert checkpoint_write_error(plain) is plain


def test_a_trainer_rank_s_storage_fault_is_resumable_and_told_by_path() -> None:
    from ray.exceptions import RayTaskError

    from megatron_quads.controller.failures import root_cause

    def task_error(cause: BaseException) -> RayTaskError:
        return RayTaskError("save", f"Traceback ...\n{type(cause).__name__}: {cause}", cause,
                            proctitle="ray::TrainerWorker.save", pid=1, ip="10.0.0.1")

    refused = storage_error(PermissionError(errno.EACCES, "Permission denied", "/r/checkpoints/step_4/trainer.partial"))
    cause = root_cause(task_error(refused))
    assert (cause.error_type, cause.resumable, cause.message) == ("StorageError", True, str(refused))
    full = root_cause(task_error(OSError(errno.ENOSPC, "No space left on device", "/scratch/x")))
    assert full.resumable and full.message.startswith("cannot write a file of the run /scratch/x: No space left")
    denied = root_cause(task_error(PermissionError(errno.EACCES, "Permission denied", "/data/model")))
    assert not denied.resumable  # reading a user's input: a resume meets it again
