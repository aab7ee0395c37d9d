"""A chain of arithmetic steps with a worked solution: long, verifiable outputs for the tiny tokenizer.

Format (only characters of the default character alphabet; a space ends each step, as the alphabet has
no newline)::

    prompt  "7 +5 *3 -4 ="                     a start value, then steps, applied left to right
    target  "7+5=12 12*3=36 36-4=32 (32);"     one "a op b=c" per step, the answer in parentheses,
                                              then the end marker ";"

Every intermediate value stays in ``[0, max_value]`` (a step that would leave it is redrawn), so the
numbers stay small however long the chain. A response is about ``8 * steps`` characters at the
defaults (``max_operand=9``, ``max_value=99``): 40 steps give ~330 tokens. The reward reads the text
before the first end marker: its last space-separated piece must be ``(N)``; N equal to the result
scores 1.0, anything else 0.0.

With ``forks`` the targets write each ``+`` and ``*`` step with its operands in either order
(``12*3=36`` or ``3*12=36``), chosen per problem and step from the prompt's id: a policy trained on them
stays uncertain at those tokens (about ln 2 nats each) without it costing reward, as a reasoning model
is at the forks of its chain of thought.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from typing import Literal

from megatron_quads.tasks.arithmetic import END_MARKER, is_eval_problem
from megatron_quads.tasks.base import (
    GeneratedTask,
    Prompt,
    RewardReason,
    RewardResult,
)

CHAIN_OPERATORS = "+-*"
_FINAL = re.compile(r"\((-?\d+)\)")
_STEP = re.compile(r"([+\-*])(\d+)")
_MAX_ATTEMPTS = 1_000


@dataclass(frozen=True)
class ChainConfig:
    """Length and range knobs of the chain task.

    A problem has between ``min_steps`` and ``max_steps`` steps; the start value is drawn from
    ``[0, max_operand]``, each step's operator from ``operators`` and its operand from
    ``[1, max_operand]``, redrawn until the new value lies in ``[0, max_value]``. ``split`` and
    ``eval_fraction`` hold out problems by the CRC-32 of their prompt, as ``ArithmeticConfig`` does.
    ``forks``: targets write commutative steps in either operand order (module docstring).
    """

    min_steps: int = 8
    max_steps: int = 8
    max_operand: int = 9
    max_value: int = 99
    operators: str = CHAIN_OPERATORS
    end_marker: str = END_MARKER
    split: Literal["all", "train", "eval"] = "all"
    eval_fraction: float = 0.1
    forks: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if self.max_value < self.max_operand:
            raise ValueError(f"max_value must be >= max_operand, got {self.max_value} < {self.max_operand}")
        if not self.operators or set(self.operators) - set(CHAIN_OPERATORS):
            raise ValueError(f"operators must be a non-empty subset of {CHAIN_OPERATORS!r}, got {self.operators!r}")
        if "-" not in self.operators and "*" not in self.operators:
            raise ValueError("operators need '-' or '*' besides '+': with '+' alone a chain leaves [0, max_value]")
        if len(self.end_marker) != 1 or self.end_marker in "0123456789=() " + CHAIN_OPERATORS:
            raise ValueError(f"end_marker must be one character other than digits, '=', '()', operators and space, "
                             f"got {self.end_marker!r}")
        if self.split not in ("all", "train", "eval"):
            raise ValueError(f"split must be 'all', 'train' or 'eval', got {self.split!r}")
        if self.split != "all" and not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1) with split={self.split!r}, got {self.eval_fraction}")

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt in characters: the start, a space, operator and operand per step, then ' ='."""
        operand = len(str(self.max_operand))
        return operand + self.max_steps * (2 + operand) + 2

    @property
    def max_answer_len(self) -> int:
        """Longest target in characters (steps, final answer, end marker): a bound for ``max_new_tokens``."""
        value, operand = len(str(self.max_value)), len(str(self.max_operand))
        return self.max_steps * (2 * value + operand + 3) + value + 3


def apply_step(value: int, op: str, operand: int) -> int:
    """``value op operand`` for one of ``+``, ``-``, ``*``."""
    if op == "+":
        return value + operand
    if op == "-":
        return value - operand
    if op == "*":
        return value * operand
    raise ValueError(f"unknown operator {op!r}")


def parse_chain(prompt_text: str) -> tuple[int, list[tuple[str, int]]]:
    """``"7 +5 *3 ="`` -> ``(7, [("+", 5), ("*", 3)])``; raises ValueError on any other text."""
    pieces = prompt_text.split(" ")
    if len(pieces) < 2 or pieces[-1] != "=" or not pieces[0].isdigit():
        raise ValueError(f"not a chain prompt: {prompt_text[:40]!r}")
    steps = []
    for piece in pieces[1:-1]:
        match = _STEP.fullmatch(piece)
        if match is None:
            raise ValueError(f"not a chain step: {piece!r} in {prompt_text[:40]!r}")
        steps.append((match[1], int(match[2])))
    return int(pieces[0]), steps


COMMUTATIVE_OPERATORS = "+*"


def worked_solution(start: int, steps: list[tuple[str, int]], end_marker: str = END_MARKER,
                    swapped: frozenset[int] = frozenset()) -> str:
    """Each step as ``a op b=c`` separated by spaces, then ``(result)`` and the end marker; the steps whose
    index is in ``swapped`` and whose operator is commutative as ``b op a=c``."""
    lines, value = [], start
    for index, (op, operand) in enumerate(steps):
        result = apply_step(value, op, operand)
        left, right = (operand, value) if index in swapped and op in COMMUTATIVE_OPERATORS else (value, operand)
        lines.append(f"{left}{op}{right}={result}")
        value = result
    return " ".join([*lines, f"({value})"]) + end_marker


def fork_choices(prompt_id: str, num_steps: int) -> frozenset[int]:
    """The steps a forked target writes with swapped operands: each with probability 1/2, from the CRC-32
    of the prompt's id and the step's index (the same prompt id always gets the same target)."""
    return frozenset(i for i in range(num_steps) if zlib.crc32(f"{prompt_id}#{i}".encode()) & 1)


class ChainTask(GeneratedTask):
    """``"7 +5 *3 ="`` -> ``"7+5=12 12*3=36 (36);"``: a left-to-right chain with every step written out."""

    def __init__(self, config: ChainConfig | None = None, name: str = "chain") -> None:
        super().__init__(config or ChainConfig(), name)

    def _draw_chain(self, rng: random.Random) -> tuple[int, list[tuple[str, int]], int]:
        cfg = self.config
        start = value = rng.randint(0, cfg.max_operand)
        steps = []
        for _ in range(rng.randint(cfg.min_steps, cfg.max_steps)):
            for _ in range(_MAX_ATTEMPTS):
                op, operand = rng.choice(cfg.operators), rng.randint(1, cfg.max_operand)
                result = apply_step(value, op, operand)
                if 0 <= result <= cfg.max_value:
                    break
            else:
                raise RuntimeError(f"no step from {value} stays in [0, {cfg.max_value}] with {cfg}; loosen it")
            steps.append((op, operand))
            value = result
        return start, steps, value

    def draw_problem(self, rng: random.Random) -> tuple[str, int]:
        """One problem ``(prompt_text, result)`` drawn from ``rng`` (in the configured split)."""
        cfg = self.config
        for _ in range(_MAX_ATTEMPTS):
            start, steps, result = self._draw_chain(rng)
            text = " ".join([str(start), *(f"{op}{operand}" for op, operand in steps), "="])
            if cfg.split != "all" and is_eval_problem(text, cfg.eval_fraction) != (cfg.split == "eval"):
                continue
            return text, result
        raise RuntimeError(f"no problem of split {cfg.split!r} in {_MAX_ATTEMPTS} draws with {cfg}")

    def target(self, prompt: Prompt) -> str:
        """The completion the policy should write: the worked steps, ``(answer)`` and the end marker."""
        start, steps = parse_chain(prompt.text)
        swapped = fork_choices(prompt.id, len(steps)) if self.config.forks else frozenset()
        return worked_solution(start, steps, self.config.end_marker, swapped)

    def score(self, prompt: Prompt, response_text: str) -> RewardResult:
        """1.0 when the last piece before the end marker is ``(N)`` with N the result; else 0.0."""
        body, has_marker, _ = response_text.partition(self.config.end_marker)
        body = body.strip()
        if not body:
            detail = "no answer before the end marker" if has_marker else "empty response"
            return RewardResult(0.0, RewardReason.EMPTY, None, detail)
        if not has_marker:
            return RewardResult(0.0, RewardReason.MALFORMED, None, f"no end marker {self.config.end_marker!r}")
        final = _FINAL.fullmatch(body.rsplit(" ", 1)[-1])
        if final is None:
            return RewardResult(0.0, RewardReason.MALFORMED, None, f"no final '(N)' in {body[-32:]!r}")
        if int(final[1]) == int(prompt.answer):
            return RewardResult(1.0, RewardReason.CORRECT, final[1])
        return RewardResult(0.0, RewardReason.WRONG, final[1], f"expected {prompt.answer}")
