"""Checks of a run's data before Ray starts, each returning what is wrong, the key and the fix (or
None): the data files exist and read, their first record holds the prompt and answer fields, the
``data`` keys fit the task, and a chat template is there to apply. Reads one record per file (no
``datasets``, no tokenizer library), so a mistake is reported in well under a second."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_quads.controller.task_settings import KIND_FIELDS, record_fields, tokenizer_source
from megatron_quads.tasks import CharTokenizer, TaskDataError, first_record

if TYPE_CHECKING:
    from megatron_quads.controller.config import RunConfig

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _file_options(cfg: RunConfig) -> list[tuple[str, Mapping[str, Any]]]:
    """``(config key, options)`` of each data file the run reads: the task's, and its held-out one's
    when evaluation runs and the file is there (a missing one is the preflight's
    :func:`~megatron_quads.controller.preflight.check_eval_file`, which names eval.every too)."""
    assert cfg.task is not None
    found = [("task.options", cfg.task.options)]
    held_out = cfg.task.eval_options
    if cfg.eval.every and held_out is not None and Path(str(held_out.get("path", ""))).expanduser().is_file():
        found.append(("task.eval_options", held_out))
    return found


def _field_problem(cfg: RunConfig, key: str, path: str, record: Mapping[str, Any], options: Mapping[str, Any]) -> str | None:
    prompt, answer = record_fields(cfg, options)
    for data_key, field in (("data.prompt_key", prompt), ("data.answer_key", answer)):
        if record.get(field) is None:
            state = "is null in" if field in record else "is not a field of"
            return (f"{data_key}: the field {field!r} {state} the first record of {path} ({key}.path; its fields: "
                    f"{sorted(record)}); set {data_key} to the field that holds the "
                    f"{'prompt' if data_key == 'data.prompt_key' else 'ground truth'}")
    return None


def _char_problem(cfg: RunConfig, key: str, path: str, record: Mapping[str, Any], options: Mapping[str, Any]) -> str | None:
    """The character tokenizer knows digits and operators only: a data file's text it cannot encode."""
    if tokenizer_source(cfg) != "char":
        return None
    text = str(record.get(record_fields(cfg, options)[0], ""))
    try:
        CharTokenizer().encode(text)
    except ValueError as err:
        return (f"task.tokenizer=char cannot encode the prompts of {path} ({key}.path): {err}; set model.hf_path to a "
                "Hugging Face model directory (its tokenizer is used), or task.tokenizer to a tokenizer directory")
    return None


def data_file_problem(cfg: RunConfig) -> str | None:
    """Each data file of a data-file task exists and reads, and its first record holds the prompt and
    answer fields (``data.prompt_key`` / ``data.answer_key``, else the task kind's) and text the
    run's tokenizer can encode."""
    if cfg.task is None or cfg.task.kind not in KIND_FIELDS:
        return None
    for key, options in _file_options(cfg):
        path = options.get("path")
        if not path:
            return f"{key}.path is not set: task.kind={cfg.task.kind} reads its problems from a local file; set {key}.path"
        try:
            record = first_record(str(path))
        except TaskDataError as err:
            return f"{key}.path: {err}"
        problem = _field_problem(cfg, key, str(path), record, options) or _char_problem(cfg, key, str(path), record, options)
        if problem:
            return problem
    return None


def data_keys_problem(cfg: RunConfig) -> str | None:
    """``data.prompt_key`` / ``data.answer_key`` name fields of a data file: the arithmetic task has none."""
    if cfg.task is not None and cfg.task.kind in KIND_FIELDS:
        return None
    given = [f"data.{k}" for k in ("prompt_key", "answer_key") if getattr(cfg.data, k) is not None]
    if not given:
        return None
    return (f"{', '.join(given)} name{'s' if len(given) == 1 else ''} a data file's fields, but the task is the arithmetic "
            f"one: set task.kind (gsm8k, math or qa) and task.options.path, or drop {', '.join(given)}")


def _has_chat_template(directory: Path) -> bool:
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        return True
    config = directory / "tokenizer_config.json"
    try:
        return bool(config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError):
        return False


def chat_template_problem(cfg: RunConfig) -> str | None:
    """``data.apply_chat_template`` needs a Hugging Face tokenizer directory whose tokenizer has a chat
    template (``chat_template`` in ``tokenizer_config.json``, or ``chat_template.jinja``)."""
    if not cfg.data.apply_chat_template:
        return None
    source = tokenizer_source(cfg)
    if source is None or source == "char" or not Path(source).expanduser().is_dir():
        return ("data.apply_chat_template=true needs a Hugging Face tokenizer with a chat template, but the run's "
                f"tokenizer is {source or 'the embedded character one'}: set model.hf_path (or task.tokenizer) to a "
                "directory with one, or set data.apply_chat_template=false")
    if not _has_chat_template(Path(source).expanduser()):
        return (f"data.apply_chat_template=true but the tokenizer in {source} has no chat template (no chat_template "
                f"in its tokenizer_config.json, no {CHAT_TEMPLATE_FILE}): add one, or set data.apply_chat_template=false")
    return None


DATA_CHECKS = (data_keys_problem, chat_template_problem, data_file_problem)
"""The data checks :func:`~megatron_quads.controller.config.check_runnable` runs, in order."""
