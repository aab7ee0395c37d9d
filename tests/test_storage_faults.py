"""Storage faults (a full disk, a missing permission, a read-only filesystem) told by path, cause and
fix: the translation rules, the dist-checkpoint unwrapping, and a run that meets one before Ray starts.
Runs that meet one mid-run: tests/test_interrupted_runs.py."""

from __future__ import annotations

import builtins
import errno
import io
import os
import pickle
import traceback
from pathlib import Path

import pytest

from megatron_quads.controller.config import load_config
from megatron_quads.controller.faults import (
    StorageError,
    checkpoint_write_error,
    is_storage_fault,
    storage_error,
)

EXAMPLE = Path(__file__).parents[1] / "examples" / "embedded_default.yaml"


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


SHORT = ["rollout.engine=torch", "logging.wandb=disabled", "grpo.steps=1", "grpo.prompts_per_step=2",
         "grpo.responses_per_prompt=2", "rollout.max_new_tokens=2"]
"""A short run: should a fault not fire, the test fails in seconds, not after the default run."""


def _config(run_dir: Path):
    return load_config(EXAMPLE, [f"run_dir={run_dir}", *SHORT])


def test_a_full_disk_at_the_lock_stops_with_the_path_the_cause_and_exit_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_quads import cli
    from megatron_quads.controller.run import run

    run_dir = tmp_path / "run"

    def no_space(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", no_space)
    with pytest.raises(StorageError) as fault:
        run(_config(run_dir))
    assert str(fault.value) == (
        f"cannot write the run_dir lock {run_dir / '.lock'}: No space left on device (ENOSPC); free space on that "
        "filesystem\nno checkpoint was written yet; start the run again with the command that started it")
    assert cli.main(["train", str(EXAMPLE), *SHORT, f"run_dir={run_dir}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"training stopped: cannot write the run_dir lock {run_dir / '.lock'}: No space left")
    assert "Traceback" not in err


def test_a_full_disk_at_the_config_keeps_the_saved_one_and_names_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_quads.controller.run import run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("seed: 0\n")  # a config before this run's (no records: not compared)
    real_open = builtins.open

    def full_for_configs(file, mode="r", *args, **kwargs):
        if "w" in mode and Path(file).name.startswith(".config."):
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_for_configs)
    monkeypatch.setattr(io, "open", full_for_configs)
    with pytest.raises(StorageError) as fault:
        run(_config(run_dir))
    monkeypatch.undo()
    first, hint = str(fault.value).split("\n")
    assert first == (f"cannot write the run config {run_dir / 'config.yaml'}: No space left on device (ENOSPC); "
                     "free space on that filesystem")
    assert hint == f"no checkpoint was written yet; resume with: megatron-quads train {run_dir / 'config.yaml'}"
    assert (run_dir / "config.yaml").read_text() == "seed: 0\n"
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "config.yaml"]  # no temporary left behind
