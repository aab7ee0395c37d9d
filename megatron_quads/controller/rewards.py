"""What the task, or the run's own reward function, makes of the engines' responses: each decoded to
text and scored."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_quads.controller.custom_reward import CustomReward, mean_metrics
from megatron_quads.tasks import Prompt, Task, Tokenizer


@dataclass(frozen=True)
class StepRewards:
    """A step's rewards (one per generation) and the reward function's extra metrics, each averaged
    over the generations that returned it (``reward/<name>``; none with the task's own reward)."""

    rewards: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def decode_response(tok: Tokenizer, ids: list[int]) -> str:
    """Response text; ids outside the tokenizer (the model's vocabulary is padded) become U+FFFD,
    which no task parses, so such a response scores as malformed instead of crashing the run."""
    pieces, run = [], []
    for i in ids:
        if 0 <= i < tok.vocab_size:
            run.append(i)
            continue
        pieces.append(tok.decode(run))
        pieces.append("\ufffd")
        run = []
    pieces.append(tok.decode(run))
    return "".join(pieces)


def response_rewards(task: Task, tok: Tokenizer, prompts: list[Prompt], generations: list, n: int,
                     custom: CustomReward | None = None) -> StepRewards:
    """The reward of every generation, for ``n`` generations per prompt in prompt order: the ``custom``
    reward function's when given (with its extra metrics), else the task's."""
    responses = [decode_response(tok, g.token_ids) for g in generations]
    repeated = [p for p in prompts for _ in range(n)]
    if custom is None:
        return StepRewards(torch.tensor(task.rewards(repeated, responses)))
    scores = custom.scores(repeated, responses)
    return StepRewards(torch.tensor([s.score for s in scores]), mean_metrics(scores))
