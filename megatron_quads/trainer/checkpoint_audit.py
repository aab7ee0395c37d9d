"""Every read of a pickle or torch file from a checkpoint: audited, so none can run code.

A ``torch_dist`` checkpoint holds pickles in three places: PyTorch DCP's ``.metadata`` (read with a
plain ``pickle.load``), its non-tensor items inside the ``.distcp`` shards (read with
``torch.load(weights_only=False)``) and ``common.pt``. :func:`audit_dist_checkpoint` reads each with
an unpickler that can build nothing but plain data: ``.metadata`` may name only DCP's own
dataclasses and enums, ``torch.Size``, dtypes, layouts and paths; every other pickle must load under
``torch.load(weights_only=True)``. Nothing of the checkpoint is executed while it is audited.

The rule: no code of the package reads a checkpoint's pickles except through this module.
:func:`load_dist_checkpoint` and :func:`load_dist_tensors_metadata` audit the checkpoint, then hand
it to Megatron's loader; :func:`load_plain_data` is the one ``torch.load`` (``weights_only=True``)
of a single file (RNG state, Megatron-LM's ``common.pt``). A refusal is an
:class:`UnsafeCheckpointError` (a ``ValueError``) that names the file. ``tests/test_checkpoint_audit.py``
checks that no other module calls ``torch.load``, ``pickle`` loads or Megatron's dist-checkpoint loaders.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

_DCP_MODULES = frozenset({
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
})
_DATA_GLOBALS = frozenset({
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
})  # the checkpoint id DCP records may be a path


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds a pickle that could execute code (or cannot be read as data)."""


def _allowed_metadata_global(module: str, name: str) -> bool:
    if (module, name) in _DATA_GLOBALS:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
    if module in _DCP_MODULES:
        obj = getattr(importlib.import_module(module), name, None)
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return True
    return False


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and refuses any other global (so no callable outside the allowlist runs)."""

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed_metadata_global(module, name):
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not part of a DCP checkpoint's metadata")
        return super().find_class(module, name)


def _refuse(path: Path, why: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path}: {why}. The checkpoint was not loaded; use one written by megatron_quads (or by Megatron-Core "
        "from a source you trust), or convert the Hugging Face weights again"
    )


def read_dcp_metadata(path: Path) -> Any:
    """DCP's ``.metadata`` of checkpoint ``path``, unpickled with only DCP's own data classes allowed."""
    file = path / ".metadata"
    try:
        with open(file, "rb") as stream:
            return _MetadataUnpickler(stream).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as err:
        raise _refuse(file, f"its metadata pickle is not plain checkpoint metadata ({err})") from None


def load_plain_data(data: bytes | Path, where: Path, what: str = "the file") -> Any:
    """``torch.load(weights_only=True)`` of a file or its bytes; :class:`UnsafeCheckpointError` naming
    ``where`` and ``what`` if it is not plain data (tensors, numbers, strings, containers)."""
    try:
        return torch.load(io.BytesIO(data) if isinstance(data, bytes) else data, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure of the data-only unpickler means "not plain data"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise _refuse(where, f"{what} is not plain data ({first})") from None


_AUDITED: set[tuple] = set()
"""Signatures (:func:`_signature`) of the checkpoints audited in this process and found plain data."""


def _signature(path: Path) -> tuple:
    """The checkpoint's files as they are now (name, size, mtime, inode): a file changed or added since
    an audit makes it another checkpoint, which is audited again."""
    with os.scandir(path) as entries:
        files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns, e.stat().st_ino)
                       for e in entries if e.is_file(follow_symlinks=True))
    return (str(path.resolve()), tuple(files))


def audit_dist_checkpoint(path: str | os.PathLike[str]) -> None:
    """Raise :class:`UnsafeCheckpointError` unless every pickle of the dist checkpoint at ``path``
    (DCP metadata, non-tensor items, ``common.pt``) is plain data; read-only. A checkpoint whose
    files have not changed since it passed in this process is not read again."""
    path = Path(path)
    _check_backends(path)
    if not (path / ".metadata").exists():
        return  # not a DCP checkpoint: the loader reports what is missing
    signature = _signature(path)
    if signature in _AUDITED:
        return
    _audit(path)
    _AUDITED.add(signature)


_BACKENDS = {"sharded_backend": "torch_dist", "common_backend": "torch"}
"""What Megatron's ``metadata.json`` may name: the formats whose pickles the audit reads."""


def _check_backends(path: Path) -> None:
    """A checkpoint of another Megatron backend (zarr, ...) is refused: its files are not audited."""
    file = path / "metadata.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return  # absent or damaged: Megatron's loader reports it
    for key, allowed in _BACKENDS.items():
        value = config.get(key, allowed) if isinstance(config, dict) else allowed
        if value != allowed:
            raise _refuse(file, f"{key} is {value!r}; only {allowed!r} checkpoints are read (the audit reads their pickles)")


def _audit(path: Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_dcp_metadata(path)
    storage = getattr(metadata, "storage_data", None) or {}
    bytes_items = {fqn for fqn, meta in metadata.state_dict_metadata.items() if isinstance(meta, BytesStorageMetadata)}
    for index, info in storage.items():
        if index.fqn not in bytes_items:
            continue
        shard = path / info.relative_path
        if getattr(info, "transform_descriptors", None):
            raise _refuse(shard, f"item '{index.fqn}' is stored with transforms {list(info.transform_descriptors)}, "
                                 "which the audit cannot read")
        if shard.resolve().parent != path.resolve():
            raise _refuse(path / ".metadata", f"item '{index.fqn}' points outside the checkpoint ({info.relative_path})")
        with open(shard, "rb") as stream:
            stream.seek(info.offset)
            data = stream.read(info.length)
        if len(data) != info.length:
            raise _refuse(shard, f"item '{index.fqn}' is cut short ({len(data)} of {info.length} bytes)")
        load_plain_data(data, shard, f"item '{index.fqn}'")
    common = path / "common.pt"
    if common.exists():
        load_plain_data(common, common, "its common state")


def load_dist_checkpoint(sharded_state_dict: dict, path: str | os.PathLike[str], **kwargs: Any) -> dict:
    """``megatron.core.dist_checkpointing.load`` of ``path`` once :func:`audit_dist_checkpoint` passed it
    (``kwargs`` go to Megatron's loader)."""
    from megatron.core import dist_checkpointing

    audit_dist_checkpoint(path)
    return dist_checkpointing.load(sharded_state_dict, str(path), **kwargs)


def load_dist_tensors_metadata(path: str | os.PathLike[str]) -> dict:
    """The global shape and dtype of every tensor of the dist checkpoint at ``path`` (Megatron's
    ``load_tensors_metadata``), once :func:`audit_dist_checkpoint` passed it."""
    from megatron.core import dist_checkpointing

    audit_dist_checkpoint(path)
    return dist_checkpointing.load_tensors_metadata(str(path))
