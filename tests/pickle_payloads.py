"""Pickles that run code when loaded, for the tests of every checkpoint reader: each payload creates
a marker file, so a test sees whether anything of it ran."""

from __future__ import annotations

import operator
import pickle
from pathlib import Path
from typing import Any


class OpensAFile:
    """Unpickling this runs ``open(path, "w")``: the marker file shows whether a pickle executed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


class _ThenReturns:
    """Unpickles to ``value`` after running ``payload``: ``itemgetter(1)((payload, value))``."""

    def __init__(self, payload: Any, value: Any) -> None:
        self.payload, self.value = payload, value

    def __reduce__(self):
        return operator.itemgetter(1), ((self.payload, self.value),)


def poison_dcp_metadata(checkpoint: Path, marker: Path) -> Path:
    """Rewrite ``checkpoint/.metadata`` so that a plain unpickler creates ``marker`` and still returns
    the checkpoint's valid DCP ``Metadata`` (a loader that unpickles it works as before); returns the file."""
    file = Path(checkpoint) / ".metadata"
    with open(file, "rb") as stream:
        metadata = pickle.load(stream)  # the test's own checkpoint: plain data
    file.write_bytes(pickle.dumps(_ThenReturns(OpensAFile(marker), metadata)))
    return file
