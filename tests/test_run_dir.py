"""The run directory's rules without Ray: the lock, the resume's config check, moving records aside."""

from __future__ import annotations

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
    check_saved_config,
    hold_run_dir,
    keep_records_before,
    move_aside,
    newest_checkpoint_config,
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
