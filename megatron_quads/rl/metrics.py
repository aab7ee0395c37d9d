"""Rollout-vs-trainer mismatch metrics of one batch, over its valid (response) tokens.

With ``log r_t = logp_trainer_t - logp_rollout_t`` on tokens sampled by the rollout:

- ``gap_max_abs``, ``gap_mean_abs``: max and mean ``|log r_t|`` (the QUADS paper's gap);
- ``k3_kl``: mean of ``exp(log r) - 1 - log r``, an unbiased, non-negative estimate of
  ``KL(pi_rollout || pi_trainer)``;
- ``ratio_min``, ``ratio_max``: min and max token probability ratio ``r_t = pi_trainer / pi_rollout``;
- ``is_masked_frac``, ``is_truncated_frac``, ``is_masked_seq_frac``: what a correction did (0 without one);
- ``num_tokens``: valid tokens.

Computed in float64, returned as 0-dim tensors (float32; ``num_tokens`` int64), with no host sync.
A batch without valid tokens gives 0 for every metric except ``ratio_min = ratio_max = 1``.
"""

from __future__ import annotations

import math

import torch

from megatron_quads.rl._tensor import as_mask, check_shape, masked, safe_div
from megatron_quads.rl.correction import Correction

MISMATCH_KEYS = (
    "gap_max_abs",
    "gap_mean_abs",
    "k3_kl",
    "ratio_min",
    "ratio_max",
    "is_masked_frac",
    "is_truncated_frac",
    "is_masked_seq_frac",
    "num_tokens",
)
"""The keys :func:`mismatch_metrics` returns, always all of them."""


def mismatch_metrics(
    logp_rollout: torch.Tensor,
    logp_trainer: torch.Tensor,
    mask: torch.Tensor,
    correction: Correction | None = None,
) -> dict[str, torch.Tensor]:
    """Gap, k3 KL and ratio range between ``logp_rollout`` and ``logp_trainer`` (``[B, T]``) over ``mask``."""
    check_shape("logp_trainer", logp_trainer, logp_rollout.shape)
    valid = as_mask(mask, logp_rollout.shape)
    n = valid.sum()
    log_r = masked((logp_trainer.detach().double() - logp_rollout.detach().double()), valid)
    gap = log_r.abs()
    k3 = torch.expm1(log_r) - log_r  # exp(x) - 1 - x without the cancellation for small x
    if log_r.numel():
        gap_max = gap.amax()
        top = masked(log_r, valid, float("-inf")).amax()
        bottom = masked(log_r, valid, float("inf")).amin()
    else:
        gap_max = top = bottom = log_r.new_zeros(())
    one = log_r.new_ones(())
    has_tokens = n > 0
    out = {
        "gap_max_abs": gap_max,
        "gap_mean_abs": safe_div(gap.sum(), n),
        "k3_kl": safe_div(k3.sum(), n),
        "ratio_min": torch.where(has_tokens, bottom.exp(), one),
        "ratio_max": torch.where(has_tokens, top.exp(), one),
    }
    zero = log_r.new_zeros(())
    out["is_masked_frac"] = zero if correction is None else correction.masked_frac
    out["is_truncated_frac"] = zero if correction is None else correction.truncated_frac
    out["is_masked_seq_frac"] = zero if correction is None else correction.masked_seq_frac
    metrics = {k: v.float() for k, v in out.items()}
    metrics["num_tokens"] = n
    return metrics


HIGH_ENTROPY_FRACTION = 0.2
"""The share of a batch's tokens, by the policy's entropy, whose gap :func:`entropy_metrics` reports apart."""


def entropy_metrics(
    entropy: torch.Tensor,
    logp_rollout: torch.Tensor,
    logp_trainer: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The policy's mean entropy over ``mask`` (``entropy``, nats) and the share of the summed gap
    ``|logp_trainer - logp_rollout|`` carried by the :data:`HIGH_ENTROPY_FRACTION` of valid tokens with the
    highest entropy (``gap_high_entropy_share``: 0.2 when the gap does not depend on the entropy, towards 1
    when it lives where the policy is uncertain; 0 without a gap). All ``[B, T]``; 0-dim float32 results."""
    check_shape("entropy", entropy, logp_rollout.shape)
    check_shape("logp_trainer", logp_trainer, logp_rollout.shape)
    valid = as_mask(mask, logp_rollout.shape)
    n = valid.sum()
    h = entropy.detach().double()[valid]
    gap = (logp_trainer.detach().double() - logp_rollout.detach().double()).abs()[valid]
    top = torch.topk(h, math.ceil(HIGH_ENTROPY_FRACTION * h.numel())).indices
    total = gap.sum()
    share = torch.where(total > 0, gap[top].sum() / torch.where(total > 0, total, 1.0), 0.0)
    return {"entropy": safe_div(h.sum(), n).float(), "gap_high_entropy_share": share.float()}
