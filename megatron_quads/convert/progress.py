"""One rich progress bar for the converters (a no-op when disabled)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(enabled: bool, description: str, total: float | None = None, in_bytes: bool = False) -> Iterator[Callable[..., None]]:
    """Yield ``advance(n=1)``; with ``in_bytes`` the bar shows sizes and a transfer rate."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    counts = (DownloadColumn(), TransferSpeedColumn()) if in_bytes else (MofNCompleteColumn(),)
    with Progress(TextColumn("{task.description}"), BarColumn(), *counts, TimeElapsedColumn()) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
