"""The prompts a GRPO step or an evaluation hands the engines: token ids (in the tokenizer's chat
template with ``data.apply_chat_template``), each prompt too long for the run's positions or over
``data.max_prompt_length`` skipped and counted.

A prompt of ``n`` tokens leaves ``positions - n`` for its response; a prompt that leaves fewer than
``max_new_tokens`` is skipped (the engine would refuse it or cut its response short, and the trainer
would see a sequence past the model's positions). The arithmetic task's prompts are bounded when the
config loads (``config.response_room_problem``); a data file's are measured here, once tokenized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_quads.controller.config import RunConfig
from megatron_quads.controller.config_checks import prompt_token_limit, sequence_positions
from megatron_quads.tasks import Prompt, PromptStream, Tokenizer, encode_chat_prompt

GENERATOR_PATIENCE = 10_000
"""Consecutive too-long prompts after which a stream without a fixed size (a generator) counts as having none that fits."""


class PromptsTooLong(ValueError):
    """No prompt of the task fits in the run's positions."""


@dataclass(frozen=True)
class PromptLimit:
    """The most tokens a prompt may have, and why (the positions and the response length behind it)."""

    tokens: int
    why: str

    def __str__(self) -> str:
        return f"{self.tokens} tokens ({self.why})"


@dataclass(frozen=True)
class PromptBatch:
    """Prompts that fit, their token ids (``<bos>`` first), and how many were skipped as too long."""

    prompts: list[Prompt]
    ids: list[list[int]]
    skipped: int


def prompt_limit(cfg: RunConfig, evaluation: bool = False) -> PromptLimit | None:
    """The prompt limit of the run's rollouts (``evaluation``: of its evaluation): the room the
    positions leave besides ``max_new_tokens``, or ``data.max_prompt_length`` when that is lower;
    None when neither is known."""
    tokens, positions = prompt_token_limit(cfg, evaluation), sequence_positions(cfg)
    chosen = cfg.data.max_prompt_length
    room = None
    if tokens is not None and positions is not None:
        key = "eval.max_new_tokens" if evaluation and cfg.eval.max_new_tokens is not None else "rollout.max_new_tokens"
        room = PromptLimit(tokens, f"{positions[1]}, minus {key} = {positions[0] - tokens}")
    if chosen is not None and (room is None or chosen < room.tokens):
        return PromptLimit(chosen, "data.max_prompt_length")
    return room


def _fits(ids: Sequence[int], limit: PromptLimit | None) -> bool:
    return limit is None or len(ids) <= limit.tokens


def _patience(stream: PromptStream) -> int:
    """Consecutive skips that prove no prompt fits: two passes' worth for a dataset (any run of that
    many draws holds a whole pass), :data:`GENERATOR_PATIENCE` for a generator."""
    size = stream.state_dict().get("num_prompts")
    return 2 * int(size) if size else GENERATOR_PATIENCE


def draw_prompts(stream: PromptStream, tok: Tokenizer, n: int, limit: PromptLimit | None,
                 chat: bool = False) -> PromptBatch:
    """The next ``n`` prompts of ``stream`` that fit in ``limit`` (encoded by :func:`encode_chat_prompt`,
    in the chat template with ``chat``); the ones between them that do not are skipped (the stream moves
    past them, so a resumed run skips the same ones) and counted. Raises :class:`PromptsTooLong` when so
    many in a row are too long that none can fit."""
    prompts, ids, skipped, in_a_row, patience = [], [], 0, 0, _patience(stream)
    while len(prompts) < n:
        prompt = next(stream)
        encoded = encode_chat_prompt(tok, prompt.text, chat)
        if _fits(encoded, limit):
            prompts.append(prompt)
            ids.append(encoded)
            in_a_row = 0
            continue
        skipped += 1
        in_a_row += 1
        if in_a_row >= patience:
            raise PromptsTooLong(f"no prompt of the task fits: the last {in_a_row} drawn were all longer than {limit}; "
                                 "use shorter prompts, lower the max_new_tokens, or a model with more positions")
    return PromptBatch(prompts, ids, skipped)


def select_prompts(prompts: Sequence[Prompt], tok: Tokenizer, limit: PromptLimit | None,
                   chat: bool = False) -> PromptBatch:
    """Those of ``prompts`` that fit in ``limit`` (encoded as :func:`draw_prompts` does), with how many
    did not; raises :class:`PromptsTooLong` when none does."""
    encoded = [encode_chat_prompt(tok, p.text, chat) for p in prompts]
    kept = [(p, ids) for p, ids in zip(prompts, encoded, strict=True) if _fits(ids, limit)]
    if prompts and not kept:
        raise PromptsTooLong(f"none of the {len(prompts)} prompts fits: all are longer than {limit}; use shorter "
                             "prompts, lower the max_new_tokens, or a model with more positions")
    return PromptBatch([p for p, _ in kept], [ids for _, ids in kept], len(prompts) - len(kept))
