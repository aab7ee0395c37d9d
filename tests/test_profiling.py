"""One process's step profile (controller/profiling.py): what it writes, and that a failure to write
never stops the run."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from megatron_quads.controller.profiling import StepProfiler, phase_lines


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


def test_a_phase_is_one_row_with_its_cpu_time_its_kernels_and_its_span_on_the_gpu() -> None:
    """On a GPU the profiler reports a marked region twice: on the CPU (with the device time of the
    kernels launched inside) and as an annotation on the device's timeline (its span); the table joins
    them, and a region seen only on one side shows '-' for the other."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key: str, device: DeviceType, count: int, cpu_us: float, device_us: float) -> SimpleNamespace:
        return SimpleNamespace(key=key, device_type=device, count=count, cpu_time_total=cpu_us,
                               device_time_total=device_us)

    averages = [event("quads/sync_load", DeviceType.CPU, 1, 2_598_540, 15_240),
                event("aten::copy_", DeviceType.CPU, 9, 100, 10),
                event("quads/sync_load", DeviceType.CUDA, 1, 0, 2_362_510),
                event("quads/generate", DeviceType.CPU, 1, 3_367_690, 20_100),
                event("quads/generate", DeviceType.CUDA, 2, 0, 6_525_350),
                event("quads/only_on_gpu", DeviceType.CUDA, 1, 0, 1_000)]
    rows = [line.split() for line in phase_lines(averages, "rollout_engine0").splitlines()[2:]]
    assert rows == [["quads/generate", "1", "3367.69", "20.10", "6525.35"],
                    ["quads/sync_load", "1", "2598.54", "15.24", "2362.51"],
                    ["quads/only_on_gpu", "1", "-", "-", "1.00"]]


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
