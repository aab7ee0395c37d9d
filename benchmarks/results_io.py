"""Writing benchmark results: a JSON history of records and a Markdown view, never half-written."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_quads.atomic_io import write_text_atomic

__all__ = ["append_record", "write_text_atomic"]


def append_record(json_path: Path, record: dict, markdown_path: Path | None = None, markdown: str = "") -> None:
    """Append ``record`` to the JSON list at ``json_path`` and (optionally) rewrite the Markdown view."""
    history = json.loads(json_path.read_text()) if json_path.exists() else []
    history.append(record)
    write_text_atomic(json_path, json.dumps(history, indent=1) + "\n")
    if markdown_path is not None:
        write_text_atomic(markdown_path, markdown)
