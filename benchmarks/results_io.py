"""Benchmark results files: the newest record of each key (a section, a profile) and a Markdown view.

A results file is a JSON object ``{key: record}``. Each record says when, where and how it was
measured (``date``, ``device``, ``command``); saving a record replaces the older one under its key
and leaves the other keys as they are. Files are written to a temporary name and renamed, so a
crash leaves the previous file, never half of one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from megatron_quads.atomic_io import write_text_atomic

__all__ = ["REQUIRED_FIELDS", "load_records", "profile_markdown_path", "save_record", "write_records",
           "write_text_atomic"]

REQUIRED_FIELDS = ("date", "device", "command")
"""What every record must say: when it was measured, on what, and the command that measured it."""


def _check_record(key: str, record: dict) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"a record's key must be a non-empty string, got {key!r}")
    if not isinstance(record, dict):
        raise TypeError(f"the record under {key!r} must be a dict, got {type(record).__name__}")
    missing = [field for field in REQUIRED_FIELDS if not record.get(field)]
    if missing:
        raise ValueError(f"the record under {key!r} lacks {', '.join(missing)}: every record says "
                         f"{', '.join(REQUIRED_FIELDS)}")


def profile_markdown_path(json_path: Path, profile: str) -> Path:
    """Where a profile's Markdown table goes, beside its results file: ``<stem>_<profile>.md``."""
    json_path = Path(json_path)
    return json_path.with_name(f"{json_path.stem}_{profile}.md")


def load_records(json_path: Path) -> dict[str, dict]:
    """The records of ``json_path`` by key (empty if the file does not exist)."""
    json_path = Path(json_path)
    if not json_path.exists():
        return {}
    records = json.loads(json_path.read_text())
    if not isinstance(records, dict):
        raise ValueError(f"{json_path} holds a JSON {type(records).__name__}, not an object of records by key")
    for key, record in records.items():
        _check_record(key, record)
    return records


def write_records(json_path: Path, records: dict[str, dict], markdown_path: Path | None = None,
                  render: Callable[[dict[str, dict]], str] | None = None) -> None:
    """Write ``records`` (all of them, replacing the file) and, with ``markdown_path``, ``render(records)`` beside them."""
    for key, record in records.items():
        _check_record(key, record)
    if (markdown_path is None) != (render is None):
        raise ValueError("give both markdown_path and render, or neither")
    write_text_atomic(Path(json_path), json.dumps(records, indent=1) + "\n")
    if markdown_path is not None:
        write_text_atomic(Path(markdown_path), render(records))


def save_record(json_path: Path, key: str, record: dict, markdown_path: Path | None = None,
                render: Callable[[dict[str, dict]], str] | None = None) -> dict[str, dict]:
    """Store ``record`` under ``key`` in ``json_path`` (replacing that key's older record) and return all records.

    With ``markdown_path``, ``render(records)`` (every key's record) is written there too.
    """
    _check_record(key, record)
    records = load_records(json_path)
    records[key] = record
    write_records(json_path, records, markdown_path, render)
    return records


def publish(json_path: Path, profile: str, record: dict, text: str) -> None:
    """Store ``record`` as ``profile``'s in ``json_path``, write ``text`` (its Markdown) beside it and print it."""
    save_record(json_path, profile, record)
    write_text_atomic(profile_markdown_path(json_path, profile), text)
    print(text)
