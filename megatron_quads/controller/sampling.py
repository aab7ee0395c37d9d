"""How the engines sample: a GRPO step's rollouts and an evaluation's responses, each seeded by its step."""

from __future__ import annotations

from megatron_quads.controller.config import RunConfig
from megatron_quads.rollout.engine import SamplingParams
from megatron_quads.tasks import Tokenizer, stop_ids


def rollout_sampling(cfg: RunConfig, tok: Tokenizer, step: int) -> SamplingParams:
    """Step ``step``'s rollouts: ``rollout.*`` sampling, stopping at the tokenizer's stop tokens
    (``<eos>``, and a model directory's end-of-turn tokens), with the engines' routing returned under
    router replay r3."""
    return SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                          top_p=cfg.rollout.top_p, stop_token_ids=stop_ids(tok),
                          return_routed_experts=cfg.rollout.router_replay == "r3", seed=cfg.seed * 100003 + step)


def eval_sampling(cfg: RunConfig, tok: Tokenizer, step: int) -> SamplingParams:
    """The evaluation after ``step`` updates: ``eval.temperature`` (greedy at 0, top-p off), up to
    ``eval.max_new_tokens`` (else ``rollout.max_new_tokens``), stopping at the tokenizer's stop tokens."""
    return SamplingParams(max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                          temperature=cfg.eval.temperature, top_p=1.0 if cfg.eval.temperature == 0 else cfg.rollout.top_p,
                          seed=cfg.seed * 100003 + step + 7, stop_token_ids=stop_ids(tok))
