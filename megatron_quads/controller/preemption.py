"""Stopping a run on SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) at a safe point of the
step loop, with a checkpoint of the finished steps when the grace period leaves time for one.

The rules (docs/controller.md, "Stopping a run"): a signal during a step's rollout, reward or
log-prob phases abandons that step (nothing of it reached the trainer's weights); a signal during
the policy update waits until the step's update, record and due checkpoint are done. A second
SIGINT stops at once, without the checkpoint.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The exit status of a run a signal stopped: 128 + the signal's number (143 for SIGTERM, 130 for
    SIGINT), what a shell reports for a process that signal ended."""
    return 128 + signum


class Preempted(KeyboardInterrupt):
    """A stop signal, raised where the run may stop. A KeyboardInterrupt because Ray's blocking calls
    re-raise one from a signal handler (any other class fails inside ``ray.get``), so a handler
    catches ``KeyboardInterrupt`` and asks :attr:`StopSignals.received` whether it was a stop."""


class RunStopped(RuntimeError):
    """``run()`` ended on a stop signal: the message says where the run stopped, whether a checkpoint
    was written and how to resume; ``exit_code`` is :func:`exit_code` of the signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum, self.exit_code = signum, exit_code(signum)


class StopSignals:
    """SIGTERM and SIGINT handlers for a ``with`` block of the driver (installed only in the main
    thread; the previous handlers come back after the block).

    The first signal is recorded (:attr:`received`, :attr:`received_at`) and raises
    :class:`Preempted` at once, unless a :meth:`deferring` block runs: then it is raised when that
    block ends (:attr:`deferred` is set). A second SIGINT raises at once wherever the run is and sets
    :attr:`hurried` (no checkpoint); a repeated SIGTERM changes nothing. The handler writes nothing:
    output from a signal handler can collide with the output it interrupted.
    """

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s, self._clock = grace_s, clock
        self.received: int | None = None
        self.received_at = 0.0
        self.deferred = self.hurried = False
        self._deferring = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def name(self) -> str:
        """The received signal's name (``SIGTERM``, ``SIGINT``)."""
        return signal.Signals(self.received).name if self.received is not None else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received, self.received_at = signum, self._clock()
            if not self._deferring:
                raise Preempted(signum)
        elif signum == signal.SIGINT:
            self.hurried = True
            raise Preempted(signum)

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """Inside the block a first stop signal waits: it is raised as :class:`Preempted` once the
        block has finished (not when the block raises)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if self.received is not None and not self._deferring:
            self.deferred = True
            raise Preempted(self.received)

    def time_left(self) -> float:
        """Seconds left of the grace period since the signal (the whole period before any)."""
        if self.received is None:
            return self.grace_s
        return self.grace_s - (self._clock() - self.received_at)


def checkpoint_on_stop(stop: StopSignals, save: Callable[[], Path], *, needed: bool,
                       longest_save_s: float | None) -> str:
    """Write the stopping run's checkpoint with ``save`` when ``needed`` (steps finished since the last
    one), the stop is not :attr:`~StopSignals.hurried` and the grace period's time left covers the
    run's longest save so far (any time left when it has saved none: a save the scheduler's SIGKILL
    cuts short leaves no manifest, so the previous checkpoint stays the resume point). Returns what
    happened, for the stop's message; a failed save is reported, not raised."""
    if not needed:
        return "the last checkpoint holds every finished step"
    if stop.hurried:
        return "no checkpoint (a second SIGINT)"
    left = stop.time_left()
    if left <= 0 or (longest_save_s is not None and longest_save_s > left):
        took = f", and a checkpoint of this run took {longest_save_s:.1f} s" if longest_save_s is not None else ""
        return (f"no checkpoint: {max(left, 0.0):.1f} s of the {stop.grace_s:g} s grace period were left{took} "
                "(checkpoint.preemption_grace_s)")
    start = time.perf_counter()
    try:
        path = save()
    except KeyboardInterrupt:
        return "the checkpoint was cut short by a second SIGINT"
    except Exception as err:  # the stop's message still ends with the resume hint of the last checkpoint
        return f"the checkpoint failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return f"wrote the checkpoint {path} in {time.perf_counter() - start:.1f} s"
