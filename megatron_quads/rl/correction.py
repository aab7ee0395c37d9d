"""Importance-sampling corrections for the rollout/trainer mismatch (NVFP4 rollout, BF16/AQAT trainer).

Tokens were sampled by the rollout engine, so the policy gradient the trainer takes is off-policy by
the per-token ratio

    w_t = pi_trainer_old(y_t) / pi_rollout(y_t) = exp(logp_old_t - logp_rollout_t)

where ``logp_old`` is the trainer's (no-grad) log-prob under the weights the rollout used. Modes:

- ``none``: nothing changes;
- ``token_tis``: truncated IS, the token's policy-gradient loss is multiplied by ``min(w_t, C)``;
- ``token_mis``: masked IS, tokens with ``w_t`` outside ``[c_low, c_high]`` leave the loss;
- ``seq_mis``: a sequence leaves the loss when its geometric-mean ratio
  ``exp(mean_t log w_t)`` is outside ``[c_low, c_high]``.

The weights never carry gradient. Bounds are compared in log space (no overflow); the interval is
closed, so ``w_t = c_high`` is kept. ``c_low`` defaults to ``1 / c_high``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_quads.rl._tensor import as_mask, check_shape, masked, safe_div
from megatron_quads.rl.settings import CorrectionConfig, CorrectionMode  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class Correction:
    """What a correction does to a batch: per-token loss weights, the surviving mask, and counts."""

    weight: torch.Tensor
    """``[B, T]`` factor on each token's policy-gradient loss: ``min(w, C)`` under token_tis, else 1 (detached)."""
    mask: torch.Tensor
    """``[B, T]`` bool: response tokens still in the loss."""
    log_ratio: torch.Tensor
    """``[B, T]`` ``log w`` on response tokens, 0 elsewhere (detached)."""
    num_tokens: torch.Tensor
    """Response tokens before the correction (int64 scalar)."""
    num_masked: torch.Tensor
    """Response tokens the correction removed from the loss."""
    num_truncated: torch.Tensor
    """Response tokens whose weight was truncated (``w > C``, token_tis only)."""
    num_seqs: torch.Tensor
    """Sequences with at least one response token."""
    num_masked_seqs: torch.Tensor
    """Such sequences left with no token in the loss."""

    @property
    def masked_frac(self) -> torch.Tensor:
        """Fraction of response tokens masked out (0 for an empty batch)."""
        return safe_div(self.num_masked.float(), self.num_tokens)

    @property
    def truncated_frac(self) -> torch.Tensor:
        """Fraction of response tokens whose weight was truncated (0 for an empty batch)."""
        return safe_div(self.num_truncated.float(), self.num_tokens)

    @property
    def masked_seq_frac(self) -> torch.Tensor:
        """Fraction of non-empty sequences masked out entirely (0 for an empty batch)."""
        return safe_div(self.num_masked_seqs.float(), self.num_seqs)


def compute_correction(
    logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, config: CorrectionConfig | None = None
) -> Correction:
    """The correction of ``config`` for trainer log-probs ``logp_old`` and rollout ``logp_rollout`` (all ``[B, T]``)."""
    cfg = config or CorrectionConfig()
    if logp_old.dim() != 2:
        raise ValueError(f"logp_old must be [B, T], got shape {tuple(logp_old.shape)}")
    check_shape("logp_rollout", logp_rollout, logp_old.shape)
    valid = as_mask(mask, logp_old.shape)
    log_w = masked((logp_old.detach() - logp_rollout.detach()).float(), valid)
    weight = torch.ones_like(log_w)
    keep = valid
    truncated = torch.zeros_like(valid)
    lo, hi = (math.log(c) for c in cfg.bounds)
    if cfg.mode == CorrectionMode.TOKEN_TIS:
        truncated = valid & (log_w > hi)
        weight = log_w.clamp(max=hi).exp()
    elif cfg.mode == CorrectionMode.TOKEN_MIS:
        keep = valid & (log_w >= lo) & (log_w <= hi)
    elif cfg.mode == CorrectionMode.SEQ_MIS:
        seq_log_w = safe_div(log_w.sum(-1), valid.sum(-1))  # log of the geometric mean
        keep = valid & ((seq_log_w >= lo) & (seq_log_w <= hi))[:, None]
    nonempty = valid.any(-1)
    return Correction(
        weight=weight,
        mask=keep,
        log_ratio=log_w,
        num_tokens=valid.sum(),
        num_masked=(valid & ~keep).sum(),
        num_truncated=truncated.sum(),
        num_seqs=nonempty.sum(),
        num_masked_seqs=(nonempty & ~keep.any(-1)).sum(),
    )
