"""Synthetic integer arithmetic for the tiny embedded-default model.

Format (character level, no spaces)::

    prompt  "12+7="      operands and operators, then "="
    target  "19;"        the integer result (with "-" when negative), then the end marker ";"

Training text for warm-start SFT is ``<bos> + prompt + target + <eos>``; at rollout time the policy
gets ``<bos> + prompt`` and stops at ``<eos>`` (or at the end marker). The reward reads the text
before the first end marker: an integer equal to the result scores 1.0, anything else 0.0
(``format_reward`` for a well-formed wrong number, off by default).
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass, replace
from typing import Literal

from megatron_quads.tasks.base import (
    GeneratedTask,
    Prompt,
    RewardReason,
    RewardResult,
)

OPERATORS = "+-*"
END_MARKER = ";"
_INTEGER = re.compile(r"-?\d+")
_MAX_ATTEMPTS = 10_000


@dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty knobs of the synthetic task.

    Each prompt has between ``min_operands`` and ``max_operands`` operands; each operand has a digit
    count drawn uniformly from ``[min_digits, max_digits]`` and then a value with exactly that many
    digits (1-digit operands include 0). Operators are drawn uniformly from ``operators``; ``*``
    binds tighter than ``+``/``-`` (ordinary precedence, left to right otherwise). Without
    ``allow_negative``, problems with a negative result are redrawn.

    ``split`` keeps a fixed, seed-independent part of the problem space for evaluation: a problem is
    "eval" when the CRC-32 of its prompt text falls in the first ``eval_fraction`` of the range;
    "train" excludes those problems, "all" uses everything.
    """

    min_operands: int = 2
    max_operands: int = 2
    min_digits: int = 1
    max_digits: int = 2
    operators: str = "+-"
    allow_negative: bool = False
    end_marker: str = END_MARKER
    require_end_marker: bool = True  # a number without the end marker is malformed
    format_reward: float = 0.0  # reward for a well-formed but wrong number
    split: Literal["all", "train", "eval"] = "all"
    eval_fraction: float = 0.1
    max_prompt_chars: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.min_operands <= self.max_operands:
            raise ValueError(f"need 1 <= min_operands <= max_operands, got {self.min_operands}, {self.max_operands}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if not self.operators or set(self.operators) - set(OPERATORS):
            raise ValueError(f"operators must be a non-empty subset of {OPERATORS!r}, got {self.operators!r}")
        if len(self.end_marker) != 1 or self.end_marker in "0123456789=" + OPERATORS or self.end_marker.isspace():
            raise ValueError(
                f"end_marker must be one character other than digits, '=', operators and space, got {self.end_marker!r}"
            )
        if not 0.0 <= self.format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {self.format_reward}")
        if self.split not in ("all", "train", "eval"):
            raise ValueError(f"split must be 'all', 'train' or 'eval', got {self.split!r}")
        if self.split != "all" and not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1) with split={self.split!r}, got {self.eval_fraction}")
        if self.max_prompt_len > self.max_prompt_chars:
            raise ValueError(
                f"prompts can reach {self.max_prompt_len} characters ({self.max_operands} operands of up to "
                f"{self.max_digits} digits), over max_prompt_chars={self.max_prompt_chars}; lower max_operands "
                "or max_digits, or raise max_prompt_chars"
            )

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt: operands, operators and '='."""
        return self.max_operands * self.max_digits + (self.max_operands - 1) + 1

    @property
    def max_answer_len(self) -> int:
        """Longest target (sign, digits, end marker): a bound for ``max_new_tokens``."""
        top = 10**self.max_digits - 1
        n = self.max_operands
        biggest = top**n if "*" in self.operators else top * n
        sign = 1 if self.allow_negative and "-" in self.operators else 0
        return sign + len(str(biggest)) + 1

    @classmethod
    def level(cls, level: int, **overrides: object) -> ArithmeticConfig:
        """A preset difficulty, 0 (one-digit sums) to 5; ``overrides`` replace single fields."""
        if level not in ARITHMETIC_LEVELS:
            raise ValueError(f"arithmetic level must be one of {sorted(ARITHMETIC_LEVELS)}, got {level}")
        return replace(ARITHMETIC_LEVELS[level], **overrides)


ARITHMETIC_LEVELS: dict[int, ArithmeticConfig] = {
    0: ArithmeticConfig(min_digits=1, max_digits=1, operators="+"),  # 3+4=
    1: ArithmeticConfig(min_digits=1, max_digits=2, operators="+-"),  # 12-7=
    2: ArithmeticConfig(min_digits=1, max_digits=3, operators="+-"),  # 123+45=
    3: ArithmeticConfig(min_operands=2, max_operands=3, min_digits=1, max_digits=2, operators="+-"),  # 12+7-3=
    4: ArithmeticConfig(min_operands=2, max_operands=3, min_digits=1, max_digits=2, operators="+-*"),  # 12*3+4=
    5: ArithmeticConfig(min_operands=2, max_operands=4, min_digits=1, max_digits=3, operators="+-*"),  # 123*4-56+7=
}


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Value of ``o0 op0 o1 op1 ...`` with ``*`` before ``+``/``-``."""
    if len(operators) != len(operands) - 1:
        raise ValueError(f"{len(operands)} operands need {len(operands) - 1} operators, got {len(operators)}")
    total, term = 0, operands[0]
    sign = 1
    for op, value in zip(operators, operands[1:], strict=True):
        if op == "*":
            term *= value
        elif op in "+-":
            total += sign * term
            sign, term = (1 if op == "+" else -1), value
        else:
            raise ValueError(f"unknown operator {op!r}")
    return total + sign * term


def is_eval_problem(prompt_text: str, eval_fraction: float) -> bool:
    """Whether a problem belongs to the held-out evaluation split (independent of any seed)."""
    return zlib.crc32(prompt_text.encode()) < eval_fraction * 2**32


class ArithmeticTask(GeneratedTask):
    """``"12+7="`` → ``"19;"``: integer arithmetic with a character-level format."""

    def __init__(self, config: ArithmeticConfig | None = None, name: str = "arithmetic") -> None:
        super().__init__(config or ArithmeticConfig(), name)

    # ------------------------------------------------------------------ prompts
    def draw_problem(self, rng: random.Random) -> tuple[str, int]:
        """One problem ``(prompt_text, result)`` drawn from ``rng``."""
        cfg = self.config
        for _ in range(_MAX_ATTEMPTS):
            n = rng.randint(cfg.min_operands, cfg.max_operands)
            operands = []
            for _ in range(n):
                digits = rng.randint(cfg.min_digits, cfg.max_digits)
                operands.append(rng.randint(0, 9) if digits == 1 else rng.randint(10 ** (digits - 1), 10**digits - 1))
            operators = [rng.choice(cfg.operators) for _ in range(n - 1)]
            result = evaluate(operands, operators)
            if result < 0 and not cfg.allow_negative:
                continue
            text = "".join(f"{o}{op}" for o, op in zip(operands, operators + ["="], strict=True))
            if cfg.split != "all" and is_eval_problem(text, cfg.eval_fraction) != (cfg.split == "eval"):
                continue
            return text, result
        raise RuntimeError(f"no problem met the constraints of {cfg} in {_MAX_ATTEMPTS} draws; loosen them")

    def target(self, prompt: Prompt) -> str:
        """The completion the policy should write: the answer and the end marker."""
        return prompt.answer + self.config.end_marker

    # ------------------------------------------------------------------ reward
    def score(self, prompt: Prompt, response_text: str) -> RewardResult:
        cfg = self.config
        marker = cfg.end_marker
        body, has_marker, _ = response_text.partition(marker)
        body = body.strip()
        if not body:
            detail = "no answer before the end marker" if has_marker else "empty response"
            return RewardResult(0.0, RewardReason.EMPTY, None, detail)
        if not _INTEGER.fullmatch(body):
            return RewardResult(0.0, RewardReason.MALFORMED, None, f"not an integer: {body[:32]!r}")
        if cfg.require_end_marker and not has_marker:
            return RewardResult(0.0, RewardReason.MALFORMED, body, f"no end marker {marker!r}")
        if int(body) == int(prompt.answer):
            return RewardResult(1.0, RewardReason.CORRECT, body)
        return RewardResult(cfg.format_reward, RewardReason.WRONG, body, f"expected {prompt.answer}")
