"""The run directory's rules without Ray: the lock, the resume's config check, moving records aside."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_quads.controller.run_dir import (
    ConfigMismatch,
    RunDirBusy,
    RunDirUnusable,
    check_saved_config,
    checkpoint_dirs,
    hold_run_dir,
    keep_records_before,
    make_way_for_checkpoint,
    move_aside,
    newest_checkpoint_config,
    prepare_run_dir,
    refused_differences,
    start_records,
)
from megatron_quads.manifest import write_manifest

HOLDER = """
import sys, time
from megatron_quads.controller.run_dir import hold_run_dir
with hold_run_dir(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_holder_is_refused_with_the_first_named_until_it_ends(tmp_path: Path) -> None:
    with hold_run_dir(tmp_path):
        with pytest.raises(RunDirBusy, match=rf"in use by another run: pid {os.getpid()}@{socket.gethostname()} since "
                                             r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ .*another directory \(run_dir=\.\.\.\)"):
            with hold_run_dir(tmp_path):  # another open file description, same process
                pass
    with hold_run_dir(tmp_path):  # released when the holder's block ended
        pass
    assert (tmp_path / ".lock").read_text() == ""


def test_the_lock_of_a_process_that_dies_is_released(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunDirBusy, match=rf"pid {holder.pid}@"), hold_run_dir(tmp_path):
            pass
    finally:
        holder.kill()
        holder.wait()
    with hold_run_dir(tmp_path):
        pass


def test_a_filesystem_without_flock_runs_unlocked_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    import fcntl

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with hold_run_dir(tmp_path), hold_run_dir(tmp_path):  # nothing keeps the second out
        pass
    assert "this filesystem has no flock, so nothing keeps a second run out" in caplog.text


SAVED = {"run_dir": "runs/a", "seed": 0, "precision": {"mode": "quads", "rac_ratio": 0.25}, "task": None,
         "grpo": {"steps": 3, "optim": {"lr": 1e-4}}, "logging": {"wandb": "offline"}, "eval": {"every": 0},
         "checkpoint": {"every": 1, "keep_last": 2}, "rollout": {"timeout_s": 300.0, "max_retries": 2, "top_p": 1.0},
         "placement": {"ray_address": None, "mode": "disaggregated"}}


def _changed(tree: dict, **dotted) -> dict:
    tree = json.loads(json.dumps(tree))
    for key, value in dotted.items():
        *parents, leaf = key.split("__")
        node = tree
        for p in parents:
            node = node[p]
        node[leaf] = value
    return tree


def test_a_resume_may_change_only_the_resumable_keys() -> None:
    allowed = _changed(SAVED, run_dir="/abs/runs/a", grpo__steps=10, logging__wandb="online", eval__every=5,
                       checkpoint__keep_last=5, checkpoint__every=2, rollout__timeout_s=900.0, rollout__max_retries=5,
                       placement__ray_address="auto")
    assert refused_differences(SAVED, allowed) == []
    refused = _changed(allowed, seed=1, precision__mode="bf16", grpo__optim__lr=3e-4, task={"kind": "gsm8k"})
    assert refused_differences(SAVED, refused) == [
        ("seed", 0, 1), ("precision.mode", "quads", "bf16"), ("task", None, {"kind": "gsm8k"}),
        ("grpo.optim.lr", 1e-4, 3e-4)]
    new_key = _changed(SAVED, rollout__top_k=5)
    assert refused_differences(SAVED, new_key) == [("rollout.top_k", "(absent)", 5)]


def _earlier_run(run_dir: Path, records: bool = True) -> None:
    import yaml

    (run_dir / "config.yaml").write_text(yaml.safe_dump(SAVED))
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n' if records else "")


def test_a_changed_config_is_refused_with_each_key_and_the_ways_on(tmp_path: Path) -> None:
    _earlier_run(tmp_path)
    new = _changed(SAVED, seed=7, precision__mode="bf16", grpo__steps=9)
    with pytest.raises(ConfigMismatch) as refusal:
        check_saved_config(tmp_path, new, has_checkpoint=False)
    message = str(refusal.value)
    assert "\n" not in message
    assert f"whose config ({tmp_path / 'config.yaml'}) differs" in message
    assert ": seed: 0 (saved) -> 7 (now), precision.mode: 'quads' (saved) -> 'bf16' (now). " in message
    assert "grpo.steps:" not in message  # a resume may change it
    assert f"megatron-quads train {tmp_path / 'config.yaml'}" in message
    assert "new run_dir (run_dir=...)" in message and "--force-config" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "metrics.jsonl"]  # nothing moved or written
    check_saved_config(tmp_path, _changed(SAVED, grpo__steps=9), has_checkpoint=False)  # resumable keys only: passes


def test_force_config_keeps_the_saved_config_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _earlier_run(tmp_path)
    with caplog.at_level(logging.WARNING):
        check_saved_config(tmp_path, _changed(SAVED, seed=7), has_checkpoint=False, force=True)
    (aside,) = tmp_path.glob("config.*.yaml")
    assert "seed: 0" in aside.read_text() and not (tmp_path / "config.yaml").exists()
    assert str(aside) in caplog.text


def test_a_run_dir_without_checkpoint_or_records_takes_any_config(tmp_path: Path) -> None:
    _earlier_run(tmp_path, records=False)
    check_saved_config(tmp_path, _changed(SAVED, seed=7), has_checkpoint=False)
    with pytest.raises(ConfigMismatch):
        check_saved_config(tmp_path, _changed(SAVED, seed=7), has_checkpoint=True)


def test_moving_aside_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert move_aside(path, "20260101T000000Z") is None  # absent
    path.write_text("")
    assert move_aside(path, "20260101T000000Z") is None and path.exists()  # empty: nothing to keep
    (tmp_path / "metrics.20260101T000000Z.jsonl").write_text("first\n")
    path.write_text("second\n")
    assert move_aside(path, "20260101T000000Z") == tmp_path / "metrics.20260101T000000Z-1.jsonl"
    path.write_text("third\n")
    assert move_aside(path, "20260101T000000Z") == tmp_path / "metrics.20260101T000000Z-2.jsonl"
    assert [(tmp_path / f"metrics.20260101T000000Z{n}.jsonl").read_text() for n in ("", "-1", "-2")] == \
        ["first\n", "second\n", "third\n"]
    assert not path.exists()


def test_a_fresh_run_moves_earlier_records_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text('{"step": 0}\n')
    with caplog.at_level(logging.WARNING):
        start_records(path, "20260101T000000Z")
    assert path.read_text() == ""
    assert (tmp_path / "eval.20260101T000000Z.jsonl").read_text() == '{"step": 0}\n'
    assert str(tmp_path / "eval.20260101T000000Z.jsonl") in caplog.text


def test_a_resume_keeps_earlier_steps_and_the_whole_original_aside(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    original = '{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "rew'  # a run stopped mid-write
    path.write_text(original)
    keep_records_before(path, 2, "20260101T000000Z")
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'
    assert (tmp_path / "metrics.20260101T000000Z.jsonl").read_text() == original
    keep_records_before(path, 2, "20260101T000001Z")  # drops nothing: nothing moved aside
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'
    assert len(list(tmp_path.glob("metrics.*.jsonl"))) == 1


def _checkpoint(run_dir: Path, step: int, config: dict | None = SAVED, complete: bool = True) -> Path:
    """``checkpoints/step_N`` with a stand-in shard and, unless ``config`` is None, the config that made it."""
    import yaml

    path = run_dir / "checkpoints" / f"step_{step}"
    (path / "trainer").mkdir(parents=True)
    (path / "trainer" / "__0_0.distcp").write_bytes(bytes(range(256)))
    if config is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(config))
    write_manifest(path, {"step": step, "complete": complete})
    return path


def test_a_resume_is_checked_against_the_config_its_checkpoint_records(tmp_path: Path) -> None:
    """The checkpoint says which config made it: without config.yaml, or with another one written in its
    place, a run of another seed and precision is refused, naming the checkpoint's config."""
    older = _checkpoint(tmp_path, 2, _changed(SAVED, seed=5))
    newest = _checkpoint(tmp_path, 4)
    assert newest_checkpoint_config(tmp_path) == (newest / "config.yaml", SAVED)
    other = _changed(SAVED, seed=1, precision__mode="bf16")
    for config_yaml in (None, other):  # deleted, or overwritten with the new run's config
        if config_yaml is not None:
            import yaml

            (tmp_path / "config.yaml").write_text(yaml.safe_dump(config_yaml))
        with pytest.raises(ConfigMismatch) as refusal:
            check_saved_config(tmp_path, other, has_checkpoint=True, recorded=newest_checkpoint_config(tmp_path))
        message = str(refusal.value)
        assert "\n" not in message
        assert f"whose config ({newest / 'config.yaml'}) differs" in message
        assert "seed: 0 (saved) -> 1 (now), precision.mode: 'quads' (saved) -> 'bf16' (now)" in message
        assert f"resume with its config: megatron-quads train {newest / 'config.yaml'} (" in message
    check_saved_config(tmp_path, _changed(SAVED, grpo__steps=9), has_checkpoint=True,
                       recorded=newest_checkpoint_config(tmp_path))  # a resumable key: passes
    (newest / "config.yaml").write_text("seed: 3\n")  # its bytes changed: the resume would skip it too
    assert newest_checkpoint_config(tmp_path) == (older / "config.yaml", _changed(SAVED, seed=5))


def test_checkpoints_without_a_recorded_config_fall_back_to_config_yaml(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    _checkpoint(tmp_path, 2, config=None)
    _checkpoint(tmp_path, 4, complete=False)  # not complete: the resume skips it, so does the check
    assert newest_checkpoint_config(tmp_path) is None
    with caplog.at_level(logging.WARNING):
        check_saved_config(tmp_path, _changed(SAVED, seed=1), has_checkpoint=True, recorded=None)
    assert "cannot be checked against the run that made them" in caplog.text
    _earlier_run(tmp_path)
    with pytest.raises(ConfigMismatch, match=r"seed: 0 \(saved\) -> 1 \(now\)"):
        check_saved_config(tmp_path, _changed(SAVED, seed=1), has_checkpoint=True, recorded=None)


def test_checkpoint_dirs_and_a_stray_file_where_a_checkpoint_goes(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "checkpoints"
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 2)
    (root / "step_4").mkdir()  # being written: no manifest yet
    (root / "step_x").mkdir()
    (root / "step_8").write_text("my notes\n")  # a user's file named like a checkpoint
    assert checkpoint_dirs(tmp_path) == [root / "step_2", root / "step_10"]
    with caplog.at_level(logging.WARNING):
        make_way_for_checkpoint(root / "step_8")
    (aside,) = root.glob("step_8.stray-*")
    assert aside.read_text() == "my notes\n" and not (root / "step_8").exists()
    assert f"moved it to {aside}" in caplog.text
    (root / "step_8").write_text("")  # again, in the same second: a new name, nothing overwritten
    make_way_for_checkpoint(root / "step_8")
    assert len(list(root.glob("step_8.stray-*"))) == 2
    make_way_for_checkpoint(root / "step_4")  # an unfinished save of this run is removed
    assert not (root / "step_4").exists()
    assert checkpoint_dirs(tmp_path) == [root / "step_2", root / "step_10"]


def test_a_run_dir_where_a_file_stands_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for run_dir, culprit in [(tmp_path / "file", tmp_path / "file"), (tmp_path / "file" / "run", tmp_path / "file")]:
        with pytest.raises(RunDirUnusable) as refusal:
            prepare_run_dir(run_dir)
        assert str(refusal.value) == (f"run_dir: {culprit} is a file where the run needs a directory; move the file "
                                      "away, or choose another run_dir (run_dir=...)")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")
    with pytest.raises(RunDirUnusable, match="checkpoints is a file where the run needs a directory"):
        prepare_run_dir(tmp_path / "run")
    (tmp_path / "run" / "checkpoints").unlink()
    (tmp_path / "run" / "metrics.jsonl").mkdir()
    with pytest.raises(RunDirUnusable, match=r"metrics\.jsonl is not a regular file \(the run appends to it\)"):
        prepare_run_dir(tmp_path / "run")
    prepare_run_dir(tmp_path / "new" / "run")  # created, parents too
    assert (tmp_path / "new" / "run").is_dir()


CLI_IN_READ_ONLY_DIR = """
import json, sys
from megatron_quads import cli
rc = cli.main(["train", sys.argv[1], "rollout.engine=torch", "run_dir=" + sys.argv[2]])
print(json.dumps({"rc": rc, "heavy": [m for m in ("torch", "ray", "megatron") if m in sys.modules]}))
"""


def _without_root_overrides() -> None:
    """In the child before it runs: drop the capabilities that let root write where the permissions say
    no (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER) from the bounding set, which a root
    process's capabilities come from after exec, so the kernel checks permissions as for any user."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop = 24
    for capability in (1, 2, 3):
        if libc.prctl(pr_capbset_drop, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def test_a_read_only_run_dir_is_refused_in_one_line_before_anything_heavy(tmp_path: Path) -> None:
    """A directory this user may not write (chmod 0555). Root writes there anyway, so a root test runs the
    command without the capabilities that allow it: the kernel's own permission check either way."""
    import json

    read_only = tmp_path / "runs"
    read_only.mkdir()
    read_only.chmod(0o555)
    as_root = os.geteuid() == 0
    expected = (f"run_dir: cannot create {read_only / 'run'}: Permission denied (EACCES); give this user write "
                "permission there, or choose another run_dir")
    try:
        if not as_root:
            with pytest.raises(RunDirUnusable) as refusal:
                prepare_run_dir(read_only / "run")
            assert str(refusal.value) == expected
        repo = Path(__file__).resolve().parents[1]
        env = dict(os.environ, PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1")
        example = repo / "examples" / "embedded_default.yaml"
        result = subprocess.run([sys.executable, "-c", CLI_IN_READ_ONLY_DIR, str(example), str(read_only / "run")],
                                capture_output=True, text=True, timeout=120, env=env,
                                preexec_fn=_without_root_overrides if as_root else None, check=False)
        out = json.loads(result.stdout.strip().splitlines()[-1])
        assert out == {"rc": 2, "heavy": []}, result.stderr
        errors = [line for line in result.stderr.splitlines() if "WARNING" not in line and line.strip()]
        assert errors == [expected], result.stderr
        assert not (read_only / "run").exists()
    finally:
        read_only.chmod(0o755)
