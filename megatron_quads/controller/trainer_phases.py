"""The trainer's phases of a GRPO step: scoring the rollouts under the trainer's weights, and the
policy updates over the step's batch."""

from __future__ import annotations

import torch

from megatron_quads.controller.actor_groups import Trainers
from megatron_quads.controller.batch import mini_batches
from megatron_quads.controller.config import RunConfig
from megatron_quads.rl import entropy_metrics, mismatch_metrics


def trainer_logprobs(trainers: Trainers, batch: dict[str, torch.Tensor], reference: bool,
                     entropy: bool = False) -> dict[str, float]:
    """Add the trainer's log-probs of the rollouts to ``batch`` (``logp_old``; with ``reference`` also the
    reference policy's, ``logp_ref``), replaying the engines' routing when the batch holds it. Returns how
    far the rollouts' own log-probs are from the trainer's (``mismatch/*``; under router replay also the
    share of routing the trainer's routers would have chosen differently); with ``entropy``, also the
    policy's entropy over the response tokens (``policy/entropy``, from the same forward) and the share of
    the gap on the most uncertain fifth of them (``mismatch/gap_high_entropy_share``)."""
    routed = batch.get("routed_experts")
    mask = batch["mask"][:, 1:]
    out = {}
    if entropy:
        batch["logp_old"], token_entropy = trainers.compute_logprobs_and_entropy(batch["tokens"], routed_experts=routed)
        found = entropy_metrics(token_entropy, batch["logp_rollout"], batch["logp_old"], mask)
        out = {"policy/entropy": float(found["entropy"]),
               "mismatch/gap_high_entropy_share": float(found["gap_high_entropy_share"])}
    else:
        batch["logp_old"] = trainers.compute_logprobs(batch["tokens"], routed_experts=routed)
    if routed is not None:
        out["mismatch/routing_disagreement"] = trainers.routing_disagreement()
    if reference:
        batch["logp_ref"] = trainers.compute_logprobs(batch["tokens"], reference=True, routed_experts=routed)
    mismatch = mismatch_metrics(batch["logp_rollout"], batch["logp_old"], mask)
    return {**{f"mismatch/{k}": float(v) for k, v in mismatch.items()}, **out}


def policy_updates(cfg: RunConfig, trainers: Trainers, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
    """``grpo.epochs`` passes over the step's batch, each in ``grpo.mini_batches`` optimizer steps on
    a seeded shuffle of its sequences (PPO style; ``logp_old`` stays the pre-update log-probs, so
    the ratio and its clipping act from the second update on), all at step ``step``'s lr. Returns each
    metric's mean over the updates (``lr`` among them), the last update's under ``last_*`` and their count."""
    parts = mini_batches(batch, cfg.grpo.epochs, cfg.grpo.mini_batches, seed=cfg.seed * 1_000_003 + step)
    updates = [trainers.train_step(part, step) for part in parts]
    out = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
    if len(updates) > 1:
        out.update({f"last_{k}": v for k, v in updates[-1].items()})
    out["updates"] = float(len(updates))
    return out
