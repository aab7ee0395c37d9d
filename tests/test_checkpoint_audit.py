"""The pickle audit of dist checkpoints: plain data passes; a pickle that would run code is refused
before anything of it runs."""

from __future__ import annotations

import ast
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_quads.trainer.checkpoint_audit import (
    UnsafeCheckpointError,
    audit_dist_checkpoint,
    load_dist_checkpoint,
    load_dist_tensors_metadata,
    load_plain_data,
)
from pickle_payloads import OpensAFile as _OpensAFile
from pickle_payloads import poison_dcp_metadata

PACKAGE = Path(__file__).parents[1] / "megatron_quads"
EMBEDDED_CHECKPOINT = PACKAGE / "assets" / "tiny_moe_sft" / "checkpoint"


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


def test_poisoned_metadata_is_valid_and_runs_its_payload_under_dcps_own_reader(tmp_path) -> None:
    """The payload every reader's test uses is real: DCP's reader (what Megatron calls) returns the
    checkpoint's metadata and the marker file appears; the audit refuses it without running it."""
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = Path(shutil.copytree(EMBEDDED_CHECKPOINT, tmp_path / "ckpt"))
    clean = FileSystemReader(str(ckpt)).read_metadata()
    marker = tmp_path / "ran"
    poison_dcp_metadata(ckpt, marker)
    assert FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata == clean.state_dict_metadata
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UnsafeCheckpointError, match=r"ckpt/\.metadata: .*global 'operator\.itemgetter'"):
        audit_dist_checkpoint(ckpt)
    assert not marker.exists()


def test_the_loaders_audit_and_a_checkpoint_changed_after_its_audit_is_audited_again(tmp_path) -> None:
    ckpt = Path(shutil.copytree(EMBEDDED_CHECKPOINT, tmp_path / "ckpt"))
    audit_dist_checkpoint(ckpt)  # passes, and is remembered
    marker = tmp_path / "ran"
    poison_dcp_metadata(ckpt, marker)
    for load in (lambda: load_dist_tensors_metadata(ckpt), lambda: load_dist_checkpoint({}, ckpt)):
        with pytest.raises(UnsafeCheckpointError, match=r"ckpt/\.metadata: its metadata pickle"):
            load()
    assert not marker.exists()


def test_a_checkpoint_of_another_megatron_backend_is_refused(tmp_path) -> None:
    ckpt = Path(shutil.copytree(EMBEDDED_CHECKPOINT, tmp_path / "ckpt"))
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    with pytest.raises(UnsafeCheckpointError, match=r"metadata\.json: sharded_backend is 'zarr'; only 'torch_dist'"):
        load_dist_checkpoint({}, ckpt)


_LOADERS = {"load", "loads", "Unpickler", "load_tensors_metadata", "load_common_state_dict", "load_sharded_metadata",
            "load_plain_tensors", "load_content_metadata", "FileSystemReader", "read_metadata"}
_PICKLE_MODULES = {"pickle", "cloudpickle", "dill", "joblib"}


def _unaudited_reads(tree: ast.AST) -> list[str]:
    """Calls and imports in ``tree`` that read pickles or torch files without the audit module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in _PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in _PICKLE_MODULES:
                found.append(module)
            elif "checkpoint" in module or module == "torch":
                found += [f"{module}.{a.name}" for a in node.names if a.name in _LOADERS]
        elif isinstance(node, ast.Attribute) and node.attr in _LOADERS and isinstance(node.value, ast.Name):
            if node.value.id in {"torch", "dist_checkpointing", "dcp", "checkpoint", *_PICKLE_MODULES}:
                found.append(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "FileSystemReader":
            found.append(node.attr)
    return found


def test_no_module_reads_a_checkpoint_pickle_except_through_the_audit() -> None:
    """The one audited path: ``torch.load``, pickle loads and Megatron's / DCP's loaders appear only in
    ``trainer/checkpoint_audit.py`` (the scan itself is checked on a snippet that does all of them)."""
    snippet = ("import pickle\nimport torch\nfrom megatron.core import dist_checkpointing\n"
               "from torch.distributed.checkpoint import FileSystemReader\n"
               "torch.load(f)\npickle.loads(b)\ndist_checkpointing.load(s, d)\ndist_checkpointing.load_tensors_metadata(d)\n")
    assert len(_unaudited_reads(ast.parse(snippet))) == 6
    offenders = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        if file.relative_to(PACKAGE).as_posix() == "trainer/checkpoint_audit.py":
            continue
        reads = _unaudited_reads(ast.parse(file.read_text(), str(file)))
        if reads:
            offenders[file.relative_to(PACKAGE).as_posix()] = reads
    assert not offenders, f"read checkpoint pickles through megatron_quads.trainer.checkpoint_audit: {offenders}"
