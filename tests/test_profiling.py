"""One process's step profile (controller/profiling.py): what it writes, and that a failure to write
never stops the run."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from megatron_quads.controller.profiling import StepProfiler


def _marked_work() -> None:
    with torch.profiler.record_function("quads/sync_decode"):
        torch.randn(64, 64) @ torch.randn(64, 64)
    with torch.profiler.record_function("quads/generate"):
        for _ in range(3):
            torch.randn(128, 128) @ torch.randn(128, 128)


def test_a_profiled_step_writes_its_trace_and_a_table_of_its_phases(tmp_path: Path) -> None:
    profiler = StepProfiler()
    assert profiler.stop(tmp_path, "idle") == []  # nothing recorded: nothing written
    profiler.start()
    _marked_work()
    written = profiler.stop(tmp_path / "step_3", "rollout_engine0")
    assert sorted(Path(p).name for p in written) == ["rollout_engine0.trace.json.gz", "rollout_engine0.txt"]
    assert not profiler.running and sorted(p.name for p in (tmp_path / "step_3").iterdir()) == sorted(
        Path(p).name for p in written)  # no temporary file left
    events = json.loads(gzip.decompress((tmp_path / "step_3" / "rollout_engine0.trace.json.gz").read_bytes()))["traceEvents"]
    assert {"quads/sync_decode", "quads/generate"} <= {e.get("name") for e in events}
    phases = (tmp_path / "step_3" / "rollout_engine0.txt").read_text().split("\n\n")[0].splitlines()[2:]
    assert sorted(line.split()[:2] for line in phases) == [["quads/generate", "1"], ["quads/sync_decode", "1"]]
    assert "aten::mm" in (tmp_path / "step_3" / "rollout_engine0.txt").read_text()


def test_a_profile_that_cannot_be_written_is_logged_and_the_step_goes_on(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    profiler = StepProfiler()
    profiler.start()
    _marked_work()
    with caplog.at_level("WARNING", logger="megatron_quads.controller.profiling"):
        assert profiler.stop(blocked / "step_1", "driver") == []
    assert "the profile of driver could not be written" in caplog.text
    profiler.start()  # the next profiled step records again
    assert profiler.running
    assert len(profiler.stop(tmp_path / "step_2", "driver")) == 2
