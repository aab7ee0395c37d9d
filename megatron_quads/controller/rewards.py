"""What the task makes of the engines' responses: each decoded to text and scored."""

from __future__ import annotations

import torch

from megatron_quads.tasks import Prompt, Task, Tokenizer


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


def response_rewards(task: Task, tok: Tokenizer, prompts: list[Prompt], generations: list, n: int) -> torch.Tensor:
    """The task's reward of every generation, for ``n`` generations per prompt in prompt order."""
    responses = [decode_response(tok, g.token_ids) for g in generations]
    return torch.tensor(task.rewards([p for p in prompts for _ in range(n)], responses))
