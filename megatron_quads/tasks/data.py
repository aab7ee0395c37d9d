"""Reading task records from local JSONL, JSON or Parquet files through Hugging Face ``datasets``, with
errors that say how to fix them; :func:`first_record` peeks at one record without ``datasets`` (fast
enough for the config checks that run before Ray starts)."""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_quads.tasks.base import TaskDataError, TaskDataFileNotFoundError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
PARQUET_SUFFIXES = (".parquet", ".pq")
FIELD_HINT = "the field name option (e.g. question_field=/answer_field=, or data.prompt_key=/data.answer_key=)"


def data_file(path: str | Path) -> Path:
    """``path`` checked to be an existing file of a known type (JSONL, JSON, Parquet); raises
    :class:`TaskDataFileNotFoundError` or :class:`TaskDataError` saying what to fix."""
    path = Path(path).expanduser()
    if not path.exists():
        raise TaskDataFileNotFoundError(
            f"data file {path} does not exist (resolved: {path.resolve()}); check the path, or download the "
            "dataset to that location first (runs have no network access)"
        )
    if path.is_dir():
        raise TaskDataError(f"{path} is a directory; pass the path of one .jsonl, .json or .parquet file inside it")
    if path.suffix.lower() not in (*JSONL_SUFFIXES, *JSON_SUFFIXES, *PARQUET_SUFFIXES):
        raise TaskDataError(
            f"{path}: unknown file type {path.suffix.lower()!r}; use JSONL ({', '.join(JSONL_SUFFIXES)}), JSON "
            f"(.json) or Parquet ({', '.join(PARQUET_SUFFIXES)})"
        )
    return path


def _json_line(path: Path, lineno: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskDataError(
            f"{path}, line {lineno}: not valid JSON ({e.msg} at column {e.pos + 1}): {line[:80]!r}. "
            "A JSONL file holds one JSON object per line; fix or drop that line"
        ) from None


def _record_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each non-blank line of a JSONL file (blank lines hold no record)."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield lineno, line.strip()


def _json_document(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TaskDataError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}). A .json file must hold "
            "a list of objects; for one object per line name the file .jsonl"
        ) from None


def _json_list_key(path: Path, data: Any) -> str | None:
    """The key of a .json file's records: None for a top-level list, the one list-valued key of an
    object (``{"data": [...]}``); else TaskDataError."""
    if isinstance(data, list):
        return None
    if isinstance(data, dict):
        keys = [k for k, v in data.items() if isinstance(v, list)]
        if len(keys) == 1:
            return keys[0]
    raise TaskDataError(f"{path}: a .json file must hold a list of objects, found {type(data).__name__}")


def _check_fields(where: str, record: Any, fields: Sequence[str], present: Sequence[str] | None = None) -> None:
    """Every name in ``fields`` holds a value in ``record``; ``present``: the file's columns, when known
    (a column absent from the whole file is missing, one that is None in this record missing or null)."""
    if not isinstance(record, dict):
        raise TaskDataError(f"{where}: expected a JSON object, found {type(record).__name__}: {str(record)[:80]!r}")
    columns = list(record) if present is None else list(present)
    for name in fields:
        if name in columns and record.get(name) is not None:
            continue
        if name not in columns:
            state = "is missing"
        else:
            state = "is null" if present is None else "is missing or null"
        filled = sorted(k for k in columns if record.get(k) is not None)
        raise TaskDataError(
            f"{where}: field {name!r} {state} (fields present: {filled}); every record needs it. "
            f"If the data names it differently, set {FIELD_HINT} to the right key"
        )


def first_record(path: str | Path, fields: Sequence[str] = ()) -> dict[str, Any]:
    """The first record of a data file, checked to hold every name in ``fields`` (the rule of
    :func:`read_records`, applied to one record). Reads one line of a JSONL file, one row of a Parquet
    file (pyarrow), the whole of a .json file; imports no ``datasets``."""
    path = data_file(path)
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        lineno, line = next(_record_lines(path), (None, ""))
        if lineno is None:
            raise TaskDataError(f"{path}: the file holds no records")
        record, where = _json_line(path, lineno, line), f"{path}, line {lineno}"
    elif suffix in JSON_SUFFIXES:
        data = _json_document(path)
        key = _json_list_key(path, data)
        rows = data if key is None else data[key]
        if not rows:
            raise TaskDataError(f"{path}: the file holds no records")
        record, where = rows[0], f"{path}, record 0"
    else:
        record, where = _first_parquet_row(path, fields), f"{path}, record 0"
    _check_fields(where, record, fields)
    return record


def _first_parquet_row(path: Path, fields: Sequence[str]) -> dict[str, Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TaskDataError(
            f"{path}: reading Parquet needs pyarrow; install it (pip install pyarrow) or convert the file to JSONL"
        ) from None
    try:
        file = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
        raise TaskDataError(f"{path}: not a readable Parquet file ({e})") from None
    _check_columns(path, file.schema_arrow.names, fields)
    batch = next(file.iter_batches(batch_size=1), None)
    if batch is None or batch.num_rows == 0:
        raise TaskDataError(f"{path}: the file holds no records")
    return batch.to_pylist()[0]


def _check_columns(path: Path, columns: Sequence[str], fields: Sequence[str]) -> None:
    missing = [f for f in fields if f not in columns]
    if missing:
        raise TaskDataError(
            f"{path}: no column {missing[0]!r} (columns: {list(columns)}); set {FIELD_HINT} to one of these columns"
        )


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """``datasets``, with its progress bars and its own error logging off (the errors raised here say
    more), restored afterwards."""
    try:
        import datasets
    except ImportError:
        raise TaskDataError("reading data files needs Hugging Face datasets: pip install datasets") from None
    bars = datasets.is_progress_bar_enabled()
    level = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(logging.CRITICAL)
    try:
        yield datasets
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _load(path: Path) -> Any:
    """The file as a ``datasets.Dataset`` held in memory (its Arrow cache in a temporary directory, so
    an edited file is always read again)."""
    suffix = path.suffix.lower()
    options: dict[str, Any] = {}
    if suffix in JSON_SUFFIXES:
        key = _json_list_key(path, _json_document(path))
        if key is not None:
            options["field"] = key
    builder = "parquet" if suffix in PARQUET_SUFFIXES else "json"
    with _quiet_datasets() as datasets, tempfile.TemporaryDirectory(prefix="mq-datasets-") as cache:
        try:
            return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache,
                                         keep_in_memory=True, **options)
        except Exception as err:  # datasets wraps the reader's error (pyarrow's, json's) in its own
            raise _read_error(path, err) from err


def _read_error(path: Path, err: Exception) -> TaskDataError:
    """What is wrong with a file ``datasets`` could not read: the first bad JSONL line, no records, or
    the reader's own message."""
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return TaskDataError(f"{path}: not a readable Parquet file ({err.__cause__ or err})")
    if suffix in JSONL_SUFFIXES:
        lines = list(_record_lines(path))
        if not lines:
            return TaskDataError(f"{path}: the file holds no records")
        for lineno, line in lines:
            record = _json_line(path, lineno, line)  # raises on the first line that is not JSON
            _check_fields(f"{path}, line {lineno}", record, ())
    return TaskDataError(f"{path}: datasets could not read it ({err.__cause__ or err})")


def read_records(path: str | Path, fields: Sequence[str]) -> list[dict[str, Any]]:
    """The records of a local data file, read by Hugging Face ``datasets``, each checked to hold every
    name in ``fields``; each record's ``_where`` names the file and its line (JSONL) or index.

    ``.jsonl``/``.ndjson``: one JSON object per line (blank lines skipped); ``.json``: a list of
    objects (or an object with exactly one list value); ``.parquet``/``.pq``: one row per record.
    Raises :class:`TaskDataError` naming the file, the line or record, and the missing field;
    :class:`TaskDataFileNotFoundError` when the file does not exist.
    """
    path = data_file(path)
    suffix = path.suffix.lower()
    dataset = _load(path)
    if suffix in PARQUET_SUFFIXES:
        _check_columns(path, dataset.column_names, fields)
    if len(dataset) == 0:
        raise TaskDataError(f"{path}: the file holds no records")
    lines = [n for n, _ in _record_lines(path)] if suffix in JSONL_SUFFIXES else None
    records = []
    for i, record in enumerate(dataset.to_list()):
        where = f"{path}, line {lines[i]}" if lines else f"{path}, record {i}"
        _check_fields(where, record, fields, dataset.column_names)
        records.append({**record, "_where": where})
    return records
