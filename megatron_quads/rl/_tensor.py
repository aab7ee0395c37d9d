"""Shape checks and masking helpers shared by the GRPO math (no host syncs)."""

from __future__ import annotations

import torch


def check_shape(name: str, x: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``x`` has exactly ``shape``."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def as_mask(mask: torch.Tensor, shape: torch.Size | tuple[int, ...], name: str = "mask") -> torch.Tensor:
    """``mask`` of ``shape`` as bool (nonzero = valid token)."""
    check_shape(name, mask, shape)
    return mask if mask.dtype == torch.bool else mask != 0


def masked(x: torch.Tensor, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``x`` where ``mask``, ``fill`` elsewhere (so padding NaN/inf never reaches the math or its gradient)."""
    return torch.where(mask, x, torch.full((), fill, dtype=x.dtype, device=x.device))


def per_token(name: str, x: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A per-sequence ``[B]`` or per-token ``[B, T]`` tensor as ``[B, T]`` (a broadcast view)."""
    if x.dim() == 1 and len(shape) == 2 and x.shape[0] == shape[0]:
        return x[:, None].expand(shape)
    check_shape(name, x, shape)
    return x


def safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` with a zero denominator read as 1 (so an empty set gives 0, never NaN)."""
    return num / den.clamp(min=1).to(num.dtype)
