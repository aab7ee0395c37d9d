"""How activations get their per-tensor (global) NVFP4 scale when they are quantized online."""

from __future__ import annotations

from enum import Enum

import torch


class ActivationScale(str, Enum):
    """How the per-tensor (global) scale of an activation is chosen."""

    PER_TOKEN = "per_token"
    """Dynamic: one global amax per token (row). The default: robust to outlier tokens."""
    PER_TENSOR = "per_tensor"
    """Dynamic: one global amax for the whole activation tensor."""
    STATIC = "static"
    """Calibrated: a fixed amax (ModelOpt's ``input_scale * 2688``)."""


def activation_amax(x: torch.Tensor, mode: ActivationScale, static_amax: float | torch.Tensor | None = None) -> torch.Tensor:
    """fp32 global amax of activations ``x [..., K]``: per token ``[...]`` or a scalar."""
    if mode == ActivationScale.PER_TOKEN:
        return x.detach().abs().amax(dim=-1).to(torch.float32)
    if mode == ActivationScale.PER_TENSOR:
        return x.detach().abs().amax().to(torch.float32)
    if static_amax is None:
        raise ValueError("ActivationScale.STATIC needs a calibrated static_amax (input_scale * 2688)")
    return torch.as_tensor(static_amax, dtype=torch.float32, device=x.device)
