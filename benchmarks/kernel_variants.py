"""Timing-only variants of a kernel module: its source with exact lines replaced, imported as its own
module (Triton and Gluon compile from the file), so a diagnostic measures the kernel itself."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def replace_anchor(src: str, old: str, new: str, file_name: str) -> str:
    """``src`` with the first ``old`` replaced by ``new``; a clear error if ``file_name`` moved it."""
    if old not in src:
        raise RuntimeError(f"{file_name} changed: the diagnostic's anchor is gone: {old.splitlines()[0]!r}")
    return src.replace(old, new, 1)


def load_source_module(module_name: str, source: str, directory: Path) -> ModuleType:
    """Write ``source`` to ``directory / <module_name>.py`` and import it under ``module_name``."""
    path = directory / f"{module_name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
