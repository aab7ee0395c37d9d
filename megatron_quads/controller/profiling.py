"""Profiling chosen GRPO steps (``profile.steps``): every process of the run (the driver, each trainer
rank, each rollout engine) records its share of such a step with ``torch.profiler`` and writes it to
``<run_dir>/profile/step_<N>/``: ``<process>.trace.json.gz`` (a Chrome / Perfetto trace) and
``<process>.txt`` (the operators and marked regions with the most self time: on a GPU process by device
time, else by CPU time). The workers mark their phases (``quads/...``) so that the table splits a
phase into its parts."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_quads.atomic_io import write_atomic, write_text_atomic

logger = logging.getLogger(__name__)

TABLE_ROWS = 50
"""Rows of the summary table: the operators and regions with the most self time."""
PHASE_PREFIX = "quads/"
"""The prefix of the regions the workers mark (``torch.profiler.record_function``)."""


class StepProfiler:
    """One process's ``torch.profiler`` over one step: :meth:`start`, the step's work, :meth:`stop`."""

    def __init__(self) -> None:
        self._profile: profile | None = None

    @property
    def running(self) -> bool:
        """Whether a step is being recorded."""
        return self._profile is not None

    def start(self, record_shapes: bool = False, with_stack: bool = False) -> None:
        """Record from now on: CPU operators, and CUDA kernels where CUDA is available. A profiler that
        fails to start is logged and the step runs unrecorded: profiling never stops a run."""
        if self._profile is not None:
            raise RuntimeError("a step is already being profiled in this process: stop it first")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        try:
            self._profile = profile(activities=activities, record_shapes=record_shapes, with_stack=with_stack)
            self._profile.start()
        except Exception:
            logger.warning("torch.profiler did not start in process %d: this step is not recorded", os.getpid(),
                           exc_info=True)
            self._profile = None

    def stop(self, directory: Path, name: str) -> list[str]:
        """Stop recording and write ``directory/name.trace.json.gz`` and ``directory/name.txt``; returns
        their paths (none when nothing was being recorded, e.g. an engine restarted during the step, or
        when writing failed: logged, the run goes on)."""
        if self._profile is None:
            return []
        recorded, self._profile = self._profile, None
        try:
            return self._write(recorded, directory, name)
        except Exception:
            logger.warning("the profile of %s could not be written to %s", name, directory, exc_info=True)
            return []

    @staticmethod
    def _write(recorded: profile, directory: Path, name: str) -> list[str]:
        recorded.stop()
        directory.mkdir(parents=True, exist_ok=True)
        trace = write_atomic(directory / f"{name}.trace.json.gz", lambda tmp: recorded.export_chrome_trace(str(tmp)))
        table = directory / f"{name}.txt"
        on_gpu = torch.cuda.is_available()
        sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        averages = recorded.key_averages()
        write_text_atomic(table, phase_lines(averages, name) + f"\n{name}: the {TABLE_ROWS} operators and regions with "
                                 f"the most {'device' if on_gpu else 'CPU'} self time\n"
                                 + averages.table(sort_by=sort_by, row_limit=TABLE_ROWS) + "\n")
        return [str(trace), str(table)]


def phase_lines(averages, name: str) -> str:
    """The marked phases (``quads/...`` regions) of one process's step: calls, CPU time and the device
    time of the work launched inside them, in milliseconds, in the order of their CPU time."""
    phases = sorted((e for e in averages if e.key.startswith(PHASE_PREFIX)), key=lambda e: -e.cpu_time_total)
    lines = [f"{name}: marked phases (ms, totals over the step)", f"{'phase':<40} {'calls':>6} {'CPU':>10} {'device':>10}"]
    for event in phases:
        device_us = getattr(event, "device_time_total", 0.0)
        lines.append(f"{event.key:<40} {event.count:>6} {event.cpu_time_total / 1e3:>10.2f} {device_us / 1e3:>10.2f}")
    return "\n".join(lines) + "\n"


class ProfiledWorker:
    """A worker's side of a profiled step: the controller calls :meth:`start_profile` on every worker
    before the step and :meth:`stop_profile` after it."""

    _step_profiler: StepProfiler | None = None

    def start_profile(self, record_shapes: bool = False, with_stack: bool = False) -> None:
        """Record this process's work from now on (``torch.profiler``)."""
        if self._step_profiler is None:
            self._step_profiler = StepProfiler()
        self._step_profiler.start(record_shapes, with_stack)

    def stop_profile(self, directory: str, name: str) -> list[str]:
        """Stop recording; write ``directory/name.trace.json.gz`` and ``name.txt`` (see :class:`StepProfiler`)."""
        return [] if self._step_profiler is None else self._step_profiler.stop(Path(directory), name)


def step_directory(run_dir: str | Path, step: int) -> Path:
    """Where a profiled step's traces and tables go: ``RUN_DIR/profile/step_<step>``."""
    return Path(run_dir) / "profile" / f"step_{step}"
