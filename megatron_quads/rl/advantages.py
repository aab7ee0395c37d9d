"""Group-normalised GRPO advantages and their broadcast to response tokens.

For a prompt's group of ``n`` responses with rewards ``r_1..r_n``:

    A_i = (r_i - mean(r)) / (std(r) + eps)      normalize_std=True  (GRPO)
    A_i =  r_i - mean(r)                        normalize_std=False (Dr. GRPO)

Only *valid* responses enter a group's statistics; invalid ones get ``A = 0``. A group whose valid
rewards are all equal (or that has fewer than two valid responses) gets exactly 0, never NaN.
"""

from __future__ import annotations

import torch

from megatron_quads.rl._tensor import as_mask, check_shape, masked
from megatron_quads.rl.settings import AdvantageConfig  # noqa: F401 (re-exported)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    config: AdvantageConfig | None = None,
    *,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-response advantages, same shape as ``rewards`` (``[P * n]`` with ``group_size=n``, or ``[P, n]``)."""
    cfg = config or AdvantageConfig()
    grouped = _grouped(rewards, group_size)
    keep = torch.ones_like(grouped, dtype=torch.bool) if valid is None else as_mask(valid, rewards.shape, "valid").reshape(grouped.shape)
    r = masked(grouped.double(), keep)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards of valid responses must be finite")
    k = keep.sum(-1, keepdim=True)
    mean = r.sum(-1, keepdim=True) / k.clamp(min=1)
    centred = masked(r - mean, keep)
    # all-equal groups: exactly 0 (r - mean can be a rounding error away from 0)
    hi = masked(r, keep, float("-inf")).amax(-1, keepdim=True) if r.shape[-1] else mean
    lo = masked(r, keep, float("inf")).amin(-1, keepdim=True) if r.shape[-1] else mean
    constant = (hi <= lo) | (k < 2)
    if cfg.normalize_std:
        dof = (k - 1) if cfg.unbiased_std else k
        std = (centred.square().sum(-1, keepdim=True) / dof.clamp(min=1)).sqrt()
        denom = torch.where(constant, torch.ones_like(std), std + cfg.eps)
        centred = centred / denom
    adv = masked(centred, keep & ~constant)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv.to(dtype).reshape(rewards.shape)


def token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-response advantages ``[B]`` broadcast to the response tokens of ``mask [B, T]`` (0 elsewhere)."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    check_shape("advantages", advantages, mask.shape[:1])
    keep = as_mask(mask, mask.shape)
    adv = advantages if advantages.is_floating_point() else advantages.float()
    return masked(adv[:, None].expand(keep.shape), keep)


def _grouped(rewards: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """``rewards`` as ``[P, n]``."""
    if rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(f"group_size={group_size} but rewards are [P, n] = {tuple(rewards.shape)}")
        return rewards
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [P * n] or [P, n], got shape {tuple(rewards.shape)}")
    if group_size is None or group_size < 1:
        raise ValueError(f"flat rewards [P * n] need group_size >= 1, got {group_size}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of group_size={group_size}")
    return rewards.reshape(-1, group_size)
