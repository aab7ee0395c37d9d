"""Atomic writes: a failed write leaves the previous file and no temporary sibling."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_quads.atomic_io import write_atomic, write_text_atomic


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "metrics.json"
    write_text_atomic(target, "old")

    def crash(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomic(target, crash)
    assert target.read_text() == "old"
    assert [p.name for p in target.parent.iterdir()] == ["metrics.json"]
    write_text_atomic(target, "new")
    assert target.read_text() == "new"


def test_the_temporary_name_keeps_the_suffix(tmp_path: Path) -> None:
    seen = []
    write_atomic(tmp_path / "plot.png", lambda tmp: (seen.append(tmp.suffix), tmp.write_bytes(b"x")))
    assert seen == [".png"]
