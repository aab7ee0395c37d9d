"""GSM8K / MATH style problems from local files, scored with math-verify.

Ground truth comes from the answer field: GSM8K answers end with ``#### <number>`` (the number,
commas removed, is the ground truth); MATH solutions hold ``\\boxed{...}`` (the content of the last
one is the ground truth); "raw" takes the field as it is. The reward is 1.0 when math-verify finds
the response's final answer (the last ``\\boxed{}`` first, else the last number or expression)
equal to the ground truth (so ``0.5``, ``1/2`` and ``\\frac{1}{2}`` all match), else 0.0.

``math_verify`` is imported on first use (the ``math`` extra); its timeouts use ``signal.alarm``,
which works only on the main thread, so off the main thread they are switched off.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from megatron_quads.tasks.base import (
    DatasetStream,
    Prompt,
    PromptStream,
    RewardReason,
    RewardResult,
    Task,
    TaskDataError,
    fingerprint,
    seed_from,
)
from megatron_quads.tasks.data import read_records

AnswerFormat = Literal["auto", "gsm8k", "boxed", "raw"]

DEFAULT_PROMPT_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."

_BOXED_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``; None if none."""
    start = max(text.rfind(cmd) for cmd in _BOXED_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOXED_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if text.startswith(" ", i) and not text.startswith("{", i):  # "\boxed 5"
        rest = text[i + 1 :].split("$")[0].strip()
        return rest.split()[0] if rest else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unbalanced braces


def gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####`` of a GSM8K answer, commas removed; None if there is none."""
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().replace(",", "")
    return answer.removesuffix(".").strip() or None


def extract_ground_truth(answer_text: str, answer_format: AnswerFormat = "auto") -> str | None:
    """The ground truth in a dataset's answer field; None when the format's marker is absent.

    "auto": ``####`` → gsm8k, else ``\\boxed`` → boxed, else raw.
    """
    text = str(answer_text).strip()
    if answer_format == "auto":
        if "####" in text:
            answer_format = "gsm8k"
        elif any(cmd in text for cmd in _BOXED_COMMANDS):
            answer_format = "boxed"
        else:
            answer_format = "raw"
    if answer_format == "gsm8k":
        return gsm8k_answer(text)
    if answer_format == "boxed":
        return last_boxed(text)
    if answer_format == "raw":
        return text or None
    raise ValueError(f"answer_format must be 'auto', 'gsm8k', 'boxed' or 'raw', got {answer_format!r}")


def _format_hint(answer_format: str) -> str:
    return {
        "gsm8k": "GSM8K answers must end with '#### <number>'",
        "boxed": "MATH solutions must contain \\boxed{<answer>}",
    }.get(answer_format, "the answer field must not be empty")


def load_math_prompts(
    path: str | Path,
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    answer_format: AnswerFormat = "auto",
    id_field: str | None = None,
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
    limit: int | None = None,
) -> list[Prompt]:
    """Prompts from a local JSONL/JSON/Parquet file of question/answer records.

    ``prompt_template`` must contain ``{question}`` (replaced literally; other braces stay as they
    are). Ids are ``record[id_field]`` or ``"<file stem>/<record index>"``.
    """
    if "{question}" not in prompt_template:
        raise ValueError(f"prompt_template must contain '{{question}}', got {prompt_template!r}")
    fields = [question_field, answer_field] + ([id_field] if id_field else [])
    records = read_records(path, fields)
    if limit is not None:
        records = records[:limit]
    stem = Path(path).stem
    prompts = []
    for i, record in enumerate(records):
        where = record["_where"]
        question = str(record[question_field]).strip()
        if not question:
            raise TaskDataError(f"{where}: field {question_field!r} is empty; every record needs a question")
        truth = extract_ground_truth(record[answer_field], answer_format)
        if truth is None:
            raise TaskDataError(
                f"{where}: no ground truth in field {answer_field!r} with answer_format={answer_format!r} "
                f"({_format_hint(answer_format)}): {str(record[answer_field])[-80:]!r}. Fix the record, or set "
                "answer_format ('gsm8k', 'boxed', 'raw') / answer_field to match the data"
            )
        prompts.append(
            Prompt(
                id=str(record[id_field]) if id_field else f"{stem}/{i}",
                text=prompt_template.replace("{question}", question),
                answer=truth,
                metadata={"source": where, "question": question,
                          "row": {k: v for k, v in record.items() if k != "_where"}},
            )
        )
    return prompts


def _parsing_timeout(timeout_s: int | None) -> int | None:
    return timeout_s if threading.current_thread() is threading.main_thread() else None


class MathTask(Task):
    """Question/answer problems with a math-verify reward; epochs over the prompts, reshuffled per epoch."""

    def __init__(
        self,
        prompts: Sequence[Prompt],
        name: str = "math",
        shuffle: bool = True,
        timeout_s: int | None = 5,
    ) -> None:
        if not prompts:
            raise ValueError("MathTask needs at least one prompt")
        self.prompts = list(prompts)
        self.name = name
        self.shuffle = shuffle
        self.timeout_s = timeout_s
        self._fingerprint = f"{name}:{len(self.prompts)}:{fingerprint([(p.id, p.answer) for p in self.prompts])}"
        self._gold_cache: dict[str, list[Any]] = {}

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        question_field: str = "question",
        answer_field: str = "answer",
        answer_format: AnswerFormat = "auto",
        id_field: str | None = None,
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        limit: int | None = None,
        name: str | None = None,
        shuffle: bool = True,
        timeout_s: int | None = 5,
    ) -> MathTask:
        prompts = load_math_prompts(
            path,
            question_field=question_field,
            answer_field=answer_field,
            answer_format=answer_format,
            id_field=id_field,
            prompt_template=prompt_template,
            limit=limit,
        )
        return cls(prompts, name=name or Path(path).stem, shuffle=shuffle, timeout_s=timeout_s)

    @classmethod
    def gsm8k(cls, path: str | Path, **kwargs: Any) -> MathTask:
        """GSM8K layout: ``question``, ``answer`` ending in ``#### <number>``."""
        kwargs = {"question_field": "question", "answer_field": "answer", "answer_format": "gsm8k", **kwargs}
        return cls.from_file(path, **kwargs)

    @classmethod
    def math(cls, path: str | Path, **kwargs: Any) -> MathTask:
        """MATH layout: ``problem``, ``solution`` containing ``\\boxed{...}``."""
        kwargs = {"question_field": "problem", "answer_field": "solution", "answer_format": "boxed", **kwargs}
        return cls.from_file(path, **kwargs)

    def __len__(self) -> int:
        return len(self.prompts)

    def __repr__(self) -> str:
        return f"MathTask(name={self.name!r}, prompts={len(self.prompts)})"

    def stream(self, seed: int = 0) -> PromptStream:
        return DatasetStream(self._fingerprint, seed_from(seed), self.prompts, shuffle=self.shuffle)

    # ------------------------------------------------------------------ reward
    def _gold(self, answer: str) -> list[Any]:
        """math-verify's reading of a ground truth; the bare string when it cannot read it."""
        if answer not in self._gold_cache:
            from math_verify import parse

            timeout = _parsing_timeout(self.timeout_s)
            gold: list[Any] = []
            for text in (f"\\boxed{{{answer}}}", f"${answer}$", answer):
                gold = parse(text, parsing_timeout=timeout)
                if gold:
                    break
            self._gold_cache[answer] = gold or [answer.strip()]
        return self._gold_cache[answer]

    def score(self, prompt: Prompt, response_text: str) -> RewardResult:
        if not response_text or not response_text.strip():
            return RewardResult(0.0, RewardReason.EMPTY, None, "empty response")
        from math_verify import parse, verify

        timeout = _parsing_timeout(self.timeout_s)
        pred = parse(response_text, parsing_timeout=timeout)
        if not pred:
            return RewardResult(0.0, RewardReason.MALFORMED, None, "no final answer found (no \\boxed{} and no number)")
        parsed = pred[-1] if isinstance(pred[-1], str) else str(pred[0])
        gold = self._gold(prompt.answer)
        if verify(gold, pred, timeout_seconds=timeout):
            return RewardResult(1.0, RewardReason.CORRECT, parsed)
        return RewardResult(0.0, RewardReason.WRONG, parsed, f"expected {prompt.answer}")
