"""Reading task records from local JSONL, JSON or Parquet files, with errors that say how to fix them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_quads.tasks.base import TaskDataError, TaskDataFileNotFoundError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
PARQUET_SUFFIXES = (".parquet", ".pq")


def _where(path: Path, line: int | None) -> str:
    return f"{path}" if line is None else f"{path}, line {line}"


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise TaskDataError(
                    f"{path}, line {lineno}: not valid JSON ({e.msg} at column {e.pos + 1}): {line[:80]!r}. "
                    "A JSONL file holds one JSON object per line; fix or drop that line"
                ) from None
    return records


def _read_json(path: Path) -> list[tuple[int | None, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TaskDataError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}). A .json file must hold "
            "a list of objects; for one object per line name the file .jsonl"
        ) from None
    if isinstance(data, dict):  # {"data": [...]} or {"train": [...]}: one list-valued key
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:
            data = lists[0]
    if not isinstance(data, list):
        raise TaskDataError(f"{path}: a .json file must hold a list of objects, found {type(data).__name__}")
    return [(None, r) for r in data]


def _read_parquet(path: Path, fields: Sequence[str]) -> list[tuple[int | None, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TaskDataError(
            f"{path}: reading Parquet needs pyarrow; install it (pip install pyarrow) or convert the file to JSONL"
        ) from None
    try:
        names = pq.read_schema(path).names
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
        raise TaskDataError(f"{path}: not a readable Parquet file ({e})") from None
    missing = [f for f in fields if f not in names]
    if missing:
        raise TaskDataError(
            f"{path}: no column {missing[0]!r} (columns: {names}); set the field name option "
            f"(e.g. question_field=/answer_field=) to one of these columns"
        )
    table = pq.read_table(path, columns=list(dict.fromkeys(fields)))
    return [(None, r) for r in table.to_pylist()]


def read_records(path: str | Path, fields: Sequence[str]) -> list[dict[str, Any]]:
    """The records of a local data file, each checked to hold every name in ``fields``.

    ``.jsonl``/``.ndjson``: one JSON object per line (blank lines skipped); ``.json``: a list of
    objects (or an object with exactly one list value); ``.parquet``/``.pq``: one row per record
    (needs pyarrow). Raises :class:`TaskDataError` naming the file, the line or record, and the
    missing field; :class:`TaskDataFileNotFoundError` when the file does not exist.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise TaskDataFileNotFoundError(
            f"data file {path} does not exist (resolved: {path.resolve()}); check the path, or download the "
            "dataset to that location first (runs have no network access)"
        )
    if path.is_dir():
        raise TaskDataError(f"{path} is a directory; pass the path of one .jsonl, .json or .parquet file inside it")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        raw = _read_jsonl(path)
    elif suffix in JSON_SUFFIXES:
        raw = _read_json(path)
    elif suffix in PARQUET_SUFFIXES:
        raw = _read_parquet(path, fields)
    else:
        raise TaskDataError(
            f"{path}: unknown file type {suffix!r}; use JSONL ({', '.join(JSONL_SUFFIXES)}), JSON (.json) or "
            f"Parquet ({', '.join(PARQUET_SUFFIXES)})"
        )
    if not raw:
        raise TaskDataError(f"{path}: the file holds no records")
    records = []
    for i, (line, record) in enumerate(raw):
        where = _where(path, line) if line is not None else f"{path}, record {i}"
        if not isinstance(record, dict):
            raise TaskDataError(f"{where}: expected a JSON object, found {type(record).__name__}: {str(record)[:80]!r}")
        for name in fields:
            if name not in record or record[name] is None:
                state = "is null" if name in record else "is missing"
                raise TaskDataError(
                    f"{where}: field {name!r} {state} (fields present: {sorted(record)}); every record needs it. "
                    f"If the data names it differently, set the field name option (e.g. question_field=/answer_field=) "
                    "to the right key"
                )
        records.append({**record, "_where": where})
    return records
