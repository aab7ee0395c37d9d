"""What a benchmark record says about the machine, and waiting for the device before reading a clock."""

from __future__ import annotations

import datetime
import platform
import sys
from pathlib import Path

import torch


def synchronize() -> None:
    """Wait for the GPU's queued work (nothing to wait for on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_name() -> str:
    """The GPU's name, or the CPU's model and the threads torch uses."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    return f"{platform.processor() or platform.machine()} CPU ({torch.get_num_threads()} threads)"


def record_stamp() -> dict[str, str]:
    """What every benchmark record starts with: the UTC date, this machine (:func:`device_name`) and
    the command that ran."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device_name(), "command": " ".join(["python", *sys.argv])}
