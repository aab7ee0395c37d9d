"""The run's TensorBoard event files (``RUN_DIR/tensorboard``): every number of every record as a
scalar, sample generations as text."""

from __future__ import annotations

import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"


def _move_dir_aside(path: Path, stamp: str) -> Path | None:
    """Rename a non-empty directory to ``<name>.<stamp>`` (``-1``, ``-2``, ... added rather than
    overwrite); returns the new path (None: nothing to move)."""
    if not path.is_dir() or not any(path.iterdir()):
        return None
    target, n = path.with_name(f"{path.name}.{stamp}"), 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{stamp}-{n}")
    path.rename(target)
    return target


class TensorBoardLog:
    """A ``SummaryWriter`` on ``RUN_DIR/tensorboard``. A fresh run moves an earlier run's event files
    aside; a run resumed at step ``resumed_at`` purges the events of the steps it does again (TensorBoard
    hides the earlier files' events from that step on)."""

    def __init__(self, run_dir: Path, resumed_at: int | None, stamp: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        path = run_dir / TENSORBOARD_DIR
        if resumed_at is None:
            aside = _move_dir_aside(path, stamp)
            if aside is not None:
                logger.warning("a fresh run in %s: the earlier %s is now %s", run_dir, path.name, aside)
        self.writer = SummaryWriter(log_dir=str(path), purge_step=resumed_at)

    def scalars(self, record: dict, step: int) -> None:
        """Every finite number of ``record`` (``step`` aside) as a scalar at ``step``, by its key."""
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)

    def text(self, tag: str, markdown: str, step: int) -> None:
        """A Markdown text (TensorBoard's text tab) at ``step``."""
        self.writer.add_text(tag, markdown, step)

    def flush(self) -> None:
        """Write what is buffered to the event file."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
