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


def test_an_append_is_whole_or_absent_when_the_disk_fills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from megatron_quads.atomic_io import append_whole

    path = tmp_path / "metrics.jsonl"
    append_whole(path, b'{"step": 0}\n')
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[: len(data) // 2]))  # full after half
    with pytest.raises(OSError) as short:
        append_whole(path, b'{"step": 1, "reward": 0.5}\n')
    assert (short.value.errno, short.value.filename) == (errno.ENOSPC, str(path))
    assert path.read_bytes() == b'{"step": 0}\n'  # the half line was cut back

    def no_space(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", no_space)
    with pytest.raises(OSError, match="No space left on device") as full:
        append_whole(path, b'{"step": 1}\n')
    assert full.value.filename == str(path) and path.read_bytes() == b'{"step": 0}\n'
    monkeypatch.undo()
    append_whole(path, b'{"step": 1}\n')
    assert path.read_bytes() == b'{"step": 0}\n{"step": 1}\n'
