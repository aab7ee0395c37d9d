"""What the run config says about its task's data, torch-free: the task options the ``data`` section
adds, the record fields a data-file task reads, and where the tokenizer comes from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_quads.controller.config import RunConfig

FIELD_OPTIONS = {"prompt_key": "question_field", "answer_key": "answer_field"}
"""``data`` keys -> the data-file task option each sets."""
KIND_FIELDS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution"), "qa": ("question", "answer")}
"""The record fields a data-file task kind reads unless told otherwise."""


def task_options(cfg: RunConfig, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` (``task.options`` or ``task.eval_options``) with ``data.prompt_key`` /
    ``data.answer_key`` as the field options of a data-file task, where set."""
    out = dict(options)
    for key, option in FIELD_OPTIONS.items():
        value = getattr(cfg.data, key)
        if value is not None:
            out[option] = value
    return out


def record_fields(cfg: RunConfig, options: Mapping[str, Any]) -> tuple[str, str]:
    """The (prompt, answer) fields a data-file task of ``cfg`` reads with ``options``."""
    assert cfg.task is not None
    question, answer = KIND_FIELDS[cfg.task.kind]
    merged = task_options(cfg, options)
    return merged.get("question_field", question), merged.get("answer_field", answer)


def tokenizer_source(cfg: RunConfig) -> str | None:
    """Where the run's tokenizer comes from: a ``task.tokenizer`` directory, else ``model.hf_path``'s
    directory, else ``task.tokenizer`` (``char``); None for the embedded default's."""
    if cfg.task is not None and cfg.task.tokenizer != "char":
        return cfg.task.tokenizer
    if cfg.model.hf_path:
        return cfg.model.hf_path
    return cfg.task.tokenizer if cfg.task is not None else None
