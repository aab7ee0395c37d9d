"""The rollout-engine interface: what the controller asks of any engine (built-in or vLLM)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron_quads.precision import Precision


@dataclass(frozen=True)
class SamplingParams:
    """How to continue each prompt. ``temperature == 0`` is greedy."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    return_routed_experts: bool = False  # fill Generation.routed_experts (router replay)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution whose log-probs engines report: ``temperature``, or 1
        when greedy (the policy's own distribution; greedy picks its argmax either way)."""
        return logprob_temperature(self.temperature)


def logprob_temperature(temperature: float) -> float:
    """``temperature``, or 1 for greedy decoding (``temperature == 0``): what trainer and engines divide logits by."""
    return temperature if temperature > 0 else 1.0


@dataclass
class Generation:
    """One completed response: its tokens and each token's log-prob under the sampling distribution.

    Log-probs are of ``softmax(logits / temperature)`` (``temperature`` 1 when greedy), before top-p
    truncation: the same quantity the trainer recomputes, so the two can be compared token by token.
    ``routed_experts`` (when asked for): the experts each fed token was routed to,
    ``[len(prompt_ids) + len(token_ids) - 1, layers, k]`` int16 (:mod:`megatron_quads.rollout.routing`).
    """

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    routed_experts: torch.Tensor | None = None


class RolloutEngine(Protocol):
    """What the GRPO controller needs of a rollout engine."""

    precision: Precision
    weight_version: int

    def load_weights(self, weights: Mapping[str, torch.Tensor] | object, version: int) -> None:
        """Swap in new weights (BF16 tensors by HF name, or QuantizedModelWeights)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """Continue every prompt; returns one Generation per prompt, in order."""
