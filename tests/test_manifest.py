"""``manifest.json``: each file's sha256 and size, checked on verify."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from megatron_quads.manifest import sha256, verify_manifest, write_manifest


def test_sha256_of_a_file_spanning_many_reads_is_that_of_its_bytes(tmp_path: Path) -> None:
    data = bytes(range(256)) * (5 * 4096 + 7)  # over 5 MiB, not a whole number of blocks
    (tmp_path / "blob").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    assert sha256(tmp_path / "blob") == hashlib.sha256(data).hexdigest()
    assert sha256(tmp_path / "empty") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_a_changed_file_fails_verification_naming_it(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 100)
    doc = write_manifest(tmp_path, {"kind": "test"})
    assert doc["files"]["weights.bin"] == {"bytes": 100, "sha256": hashlib.sha256(b"\x00" * 100).hexdigest()}
    verify_manifest(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"\x01" + b"\x00" * 99)
    with pytest.raises(ValueError, match="weights.bin does not match its sha256"):
        verify_manifest(tmp_path)
