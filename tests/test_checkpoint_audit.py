"""The pickle audit of dist checkpoints: plain data passes; a pickle that would run code is refused
before anything of it runs."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_quads.trainer.checkpoint_audit import UnsafeCheckpointError, audit_dist_checkpoint, load_plain_data


class _OpensAFile:
    """Unpickling this runs ``open(path, "w")``: the marker file shows whether a pickle executed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def _save(path: Path, state: dict) -> Path:
    dcp.save(state, checkpoint_id=str(path))
    return path


def _plain_state() -> dict:
    return {"weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": {"done": 3, "name": "x"}}


def test_a_checkpoint_of_plain_data_passes_and_its_payload_would_have_run(tmp_path) -> None:
    marker = tmp_path / "ran"
    ckpt = _save(tmp_path / "ok", _plain_state())
    audit_dist_checkpoint(ckpt)
    # the marker payload is real: a plain unpickler runs it (the refusals below are not vacuous)
    pickle.loads(pickle.dumps(_OpensAFile(marker))).close()
    assert marker.exists()


def test_a_non_tensor_item_that_runs_code_is_refused_unrun(tmp_path) -> None:
    marker = tmp_path / "ran"
    ckpt = _save(tmp_path / "evil_item", {**_plain_state(), "hook": _OpensAFile(marker)})
    with pytest.raises(UnsafeCheckpointError, match=r"item 'hook' is not plain data"):
        audit_dist_checkpoint(ckpt)
    assert not marker.exists()


def test_metadata_that_names_a_foreign_global_is_refused_unrun(tmp_path) -> None:
    marker = tmp_path / "ran"
    ckpt = _save(tmp_path / "evil_metadata", _plain_state())
    (ckpt / ".metadata").write_bytes(pickle.dumps(_OpensAFile(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: its metadata pickle .*global 'io\.open'"):
        audit_dist_checkpoint(ckpt)
    assert not marker.exists()


def test_a_common_state_that_runs_code_is_refused_unrun(tmp_path) -> None:
    marker = tmp_path / "ran"
    ckpt = _save(tmp_path / "evil_common", _plain_state())
    torch.save({"hook": _OpensAFile(marker)}, ckpt / "common.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"common\.pt: its common state is not plain data"):
        audit_dist_checkpoint(ckpt)
    assert not marker.exists()


def test_load_plain_data_returns_tensors_and_refuses_code(tmp_path) -> None:
    good, bad, marker = tmp_path / "good.pt", tmp_path / "bad.pt", tmp_path / "ran"
    torch.save({"torch": torch.arange(3), "steps_done": 2}, good)
    loaded = load_plain_data(good, good, "the RNG state")
    assert loaded["steps_done"] == 2 and torch.equal(loaded["torch"], torch.arange(3))
    torch.save(_OpensAFile(marker), bad)
    with pytest.raises(UnsafeCheckpointError, match=r"bad\.pt: the RNG state is not plain data"):
        load_plain_data(bad, bad, "the RNG state")
    assert not marker.exists()
