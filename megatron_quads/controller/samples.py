"""Sample generations of a step, for a person to read: a few prompts with a response each and its
reward (``RUN_DIR/samples.jsonl``, a wandb table, TensorBoard text)."""

from __future__ import annotations

import torch

from megatron_quads.controller.rewards import decode_response
from megatron_quads.tasks import Prompt, Tokenizer

SAMPLE_COLUMNS = ("step", "prompt", "response", "reward")


def sample_rows(step: int, prompts: list[Prompt], generations: list, rewards: torch.Tensor, n: int, tok: Tokenizer,
                count: int) -> list[dict]:
    """The first response to each of the step's first ``count`` prompts (``n`` generations per prompt,
    in prompt order), each as ``{step, prompt, response, reward}``."""
    rows = []
    for i, prompt in enumerate(prompts[:count]):
        rows.append({"step": step, "prompt": prompt.text, "response": decode_response(tok, generations[i * n].token_ids),
                     "reward": float(rewards[i * n])})
    return rows


def markdown_table(rows: list[dict]) -> str:
    """``rows`` as a Markdown table of :data:`SAMPLE_COLUMNS` (cells' ``|`` and line breaks escaped)."""

    def cell(value: object) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(row[c]) for c in SAMPLE_COLUMNS) + " |" for row in rows]
    return "\n".join(lines)
