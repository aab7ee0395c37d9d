"""Profiling chosen GRPO steps (``profile.steps``): every process of the run (the driver, each trainer
rank, each rollout engine) records its share of such a step with ``torch.profiler`` and writes it to
``<run_dir>/profile/step_<N>/``: ``<process>.trace.json.gz`` (a Chrome / Perfetto trace) and
``<process>.txt`` (the marked phases, then the operators and regions with the most self time: on a GPU
process by device time and by CPU time, else by CPU time). The workers mark their phases (``quads/...``) so that the table splits a
phase into its parts."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch.autograd import DeviceType
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
        averages = recorded.key_averages()
        # a GPU process: by device time, then by CPU time (host-bound work: launches, Python, waits on the device)
        orders = (["device", "CPU"] if torch.cuda.is_available() else ["CPU"])
        tables = [f"{name}: the {TABLE_ROWS} operators and regions with the most {order} self time\n"
                  + averages.table(sort_by=f"self_{order.lower()}_time_total", row_limit=TABLE_ROWS) for order in orders]
        write_text_atomic(table, phase_lines(averages, name) + "\n" + "\n\n".join(tables) + "\n")
        return [str(trace), str(table)]


def phase_lines(averages, name: str) -> str:
    """The marked phases (``quads/...`` regions) of one process's step, in milliseconds, in the order of
    their CPU time: calls, CPU time, the device time of the kernels launched inside them, and on a GPU
    the region's span on the device's timeline (from its first to its last work there, waits included)."""
    cpu, span = {}, {}
    for event in averages:
        if event.key.startswith(PHASE_PREFIX):
            (cpu if event.device_type == DeviceType.CPU else span)[event.key] = event
    keys = sorted(cpu.keys() | span.keys(), key=lambda k: -(cpu[k].cpu_time_total if k in cpu else 0.0))
    lines = [f"{name}: marked phases (ms, totals over the step)",
             f"{'phase':<40} {'calls':>6} {'CPU':>10} {'kernels':>10} {'GPU span':>10}"]
    for key in keys:
        host, device = cpu.get(key), span.get(key)
        calls = host.count if host is not None else device.count
        cpu_ms = f"{host.cpu_time_total / 1e3:.2f}" if host is not None else "-"
        kernels_ms = f"{getattr(host, 'device_time_total', 0.0) / 1e3:.2f}" if host is not None else "-"
        span_ms = f"{device.device_time_total / 1e3:.2f}" if device is not None else "-"
        lines.append(f"{key:<40} {calls:>6} {cpu_ms:>10} {kernels_ms:>10} {span_ms:>10}")
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
