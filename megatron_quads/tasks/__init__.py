"""Prompts and verifiable rewards for GRPO: synthetic arithmetic for the tiny model, GSM8K/MATH
style problems scored with math-verify, and the tokenizers that go with them.

Importing this package needs only the standard library; math-verify, transformers, datasets and
pyarrow are imported when first used. See docs/tasks.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_quads.tasks.arithmetic import (
    ARITHMETIC_LEVELS,
    END_MARKER,
    ArithmeticConfig,
    ArithmeticTask,
    evaluate,
)
from megatron_quads.tasks.arithmetic_chain import ChainConfig, ChainTask
from megatron_quads.tasks.base import (
    DatasetStream,
    GeneratorStream,
    Prompt,
    PromptStream,
    RewardReason,
    RewardResult,
    Task,
    TaskDataError,
    TaskDataFileNotFoundError,
)
from megatron_quads.tasks.data import first_record, read_records
from megatron_quads.tasks.math_task import (
    DEFAULT_PROMPT_TEMPLATE,
    MathTask,
    extract_ground_truth,
    gsm8k_answer,
    last_boxed,
    load_math_prompts,
)
from megatron_quads.tasks.tokenizer import (
    DEFAULT_ALPHABET,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    encode_chat_prompt,
    encode_prompt,
    encode_sft_pair,
    has_chat_template,
    load_tokenizer,
    stop_ids,
)

TASK_KINDS = ("arithmetic", "chain", "gsm8k", "math", "qa")


def make_task(kind: str, **options: Any) -> Task:
    """A task from a config entry.

    ``make_task("arithmetic", level=1)`` or ``make_task("arithmetic", max_digits=3, operators="+-*")``
    (``ArithmeticConfig`` fields, applied over ``level`` when given); ``make_task("chain", max_steps=40)``
    (``ChainConfig`` fields); ``make_task("gsm8k", path=...)``,
    ``make_task("math", path=...)``, ``make_task("qa", path=..., question_field=..., answer_field=...)``
    (``MathTask.from_file`` options).
    """
    if kind == "arithmetic":
        name = options.pop("name", "arithmetic")
        level = options.pop("level", None)
        config = ArithmeticConfig.level(level, **options) if level is not None else ArithmeticConfig(**options)
        return ArithmeticTask(config, name=name)
    if kind == "chain":
        name = options.pop("name", "chain")
        return ChainTask(ChainConfig(**options), name=name)
    if kind in ("gsm8k", "math", "qa"):
        if "path" not in options:
            raise ValueError(f"task kind {kind!r} needs path=<local .jsonl/.json/.parquet file>")
        path = Path(options.pop("path"))
        factory = {"gsm8k": MathTask.gsm8k, "math": MathTask.math, "qa": MathTask.from_file}[kind]
        return factory(path, **options)
    raise ValueError(f"unknown task kind {kind!r}; choose one of {TASK_KINDS}")


__all__ = [
    "ARITHMETIC_LEVELS",
    "DEFAULT_ALPHABET",
    "DEFAULT_PROMPT_TEMPLATE",
    "END_MARKER",
    "TASK_KINDS",
    "ArithmeticConfig",
    "ArithmeticTask",
    "ChainConfig",
    "ChainTask",
    "CharTokenizer",
    "DatasetStream",
    "GeneratorStream",
    "HFTokenizer",
    "MathTask",
    "Prompt",
    "PromptStream",
    "RewardReason",
    "RewardResult",
    "Task",
    "TaskDataError",
    "TaskDataFileNotFoundError",
    "Tokenizer",
    "encode_chat_prompt",
    "encode_prompt",
    "encode_sft_pair",
    "evaluate",
    "extract_ground_truth",
    "first_record",
    "gsm8k_answer",
    "has_chat_template",
    "last_boxed",
    "load_math_prompts",
    "load_tokenizer",
    "make_task",
    "read_records",
    "stop_ids",
]
