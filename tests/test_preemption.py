"""The driver's stop rules on SIGTERM / SIGINT, with real signals to this process: when a signal stops
the run, when it waits for the step, and when a stop writes a checkpoint. Whole runs stopped by
signals and resumed: tests/test_interrupted_runs.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from megatron_quads.controller.preemption import Preempted, StopSignals, checkpoint_on_stop, exit_code


def test_the_first_signal_stops_at_once_and_the_handlers_are_restored() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with StopSignals(30.0) as stop:
        with pytest.raises(Preempted):
            signal.raise_signal(signal.SIGTERM)
        assert (stop.received, stop.name, stop.deferred, stop.hurried) == (signal.SIGTERM, "SIGTERM", False, False)
    assert {s: signal.getsignal(s) for s in before} == before
    assert (exit_code(signal.SIGTERM), exit_code(signal.SIGINT)) == (143, 130)


def test_a_signal_during_a_deferring_block_waits_for_its_end() -> None:
    with StopSignals(30.0) as stop:
        done = []
        with pytest.raises(Preempted):
            with stop.deferring():
                signal.raise_signal(signal.SIGTERM)
                done.append("update")
                signal.raise_signal(signal.SIGTERM)  # a repeated SIGTERM changes nothing
                done.append("record")
        assert done == ["update", "record"] and stop.deferred and not stop.hurried
    with StopSignals(30.0) as stop, pytest.raises(ValueError):  # a block that fails raises its own error
        with stop.deferring():
            signal.raise_signal(signal.SIGTERM)
            raise ValueError("the update failed")


def test_a_second_sigint_stops_at_once_even_inside_a_deferring_block() -> None:
    with StopSignals(30.0) as stop:
        with pytest.raises(Preempted):
            signal.raise_signal(signal.SIGINT)
        reached = []
        with pytest.raises(Preempted):
            with stop.deferring():
                signal.raise_signal(signal.SIGINT)
                reached.append(True)
        assert reached == [] and stop.hurried


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_stop_writes_its_checkpoint_only_when_needed_and_when_it_fits_in_the_grace_period() -> None:
    clock = _Clock()
    saves: list[int] = []

    def save() -> Path:
        saves.append(1)
        return Path("/r/checkpoints/step_3")

    with StopSignals(30.0, clock=clock) as stop:
        with pytest.raises(Preempted):
            signal.raise_signal(signal.SIGTERM)
    clock.now = 110.0  # 20 s of the 30 s left
    assert stop.time_left() == 20.0
    assert checkpoint_on_stop(stop, save, needed=False, longest_save_s=1.0) == \
        "the last checkpoint holds every finished step"
    assert checkpoint_on_stop(stop, save, needed=True, longest_save_s=25.0) == (
        "no checkpoint: 20.0 s of the 30 s grace period were left, and a checkpoint of this run took 25.0 s "
        "(checkpoint.preemption_grace_s)")
    assert saves == []
    assert checkpoint_on_stop(stop, save, needed=True, longest_save_s=5.0).startswith(
        "wrote the checkpoint /r/checkpoints/step_3 in ")
    assert checkpoint_on_stop(stop, save, needed=True, longest_save_s=None).startswith("wrote the checkpoint")
    assert saves == [1, 1]
    clock.now = 131.0  # past the grace period
    assert checkpoint_on_stop(stop, save, needed=True, longest_save_s=None).startswith(
        "no checkpoint: 0.0 s of the 30 s grace period were left (checkpoint.preemption_grace_s)")

    def full() -> Path:
        raise OSError(28, "No space left on device")

    clock.now = 101.0
    assert checkpoint_on_stop(stop, full, needed=True, longest_save_s=None) == \
        "the checkpoint failed: OSError: [Errno 28] No space left on device"
    stop.hurried = True
    assert checkpoint_on_stop(stop, save, needed=True, longest_save_s=None) == "no checkpoint (a second SIGINT)"
    assert saves == [1, 1]
