"""The per-tensor level of NVFP4: the global amax and the encode / decode scales derived from it,
shared by the PyTorch reference and the Triton kernels."""

from __future__ import annotations

import torch

from megatron_quads.nvfp4.format import FLOAT32_MAX, GLOBAL_SCALE_DIVISOR
from megatron_quads.nvfp4.validation import describe_tensor

AmaxLike = float | torch.Tensor | None
"""A caller's global amax: None (take ``max(|x|)``), a number, or a tensor of one amax per leading index."""


def compute_global_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor amax, fp32 0-dim: ``max(|x|)`` over every element."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().amax().to(torch.float32)


def global_amax_tensor(global_amax: AmaxLike, x: torch.Tensor) -> torch.Tensor:
    """The fp32 amax to quantize ``x`` with: ``max(|x|)`` for None, else ``global_amax``, which must
    be finite, ``>= 0`` and broadcast against ``x.shape[:-1]``."""
    if global_amax is None:
        return compute_global_amax(x)
    amax = torch.as_tensor(global_amax, dtype=torch.float32, device=x.device)
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise ValueError(f"global_amax must be finite and >= 0, got {amax} for a {describe_tensor(x)}")
    try:
        torch.broadcast_shapes(amax.shape, x.shape[:-1])
    except RuntimeError as err:
        raise ValueError(
            f"global_amax of shape {tuple(amax.shape)} does not broadcast against the leading dims "
            f"{tuple(x.shape[:-1])} of a {describe_tensor(x)}: pass a scalar, or one amax per leading index"
        ) from err
    return amax


def global_encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = 2688 / amax`` in fp32, capped at FLT_MAX (so amax 0 gives FLT_MAX); 1 where it is 0.

    As in TE, only a zero quotient (amax = inf, which validation rejects) falls back to 1; a zero
    amax gives FLT_MAX, harmless because every block scale and code of such a tensor is 0.
    """
    divisor = torch.tensor(GLOBAL_SCALE_DIVISOR, dtype=torch.float32, device=global_amax.device)
    encode = torch.clamp(torch.div(divisor, global_amax), max=FLOAT32_MAX)
    return torch.where(encode == 0, torch.ones_like(encode), encode)


def decode_scale_from_amax(global_amax: torch.Tensor) -> torch.Tensor:
    """``weight_scale_2 = amax / 2688`` in fp32 (the per-tensor decode scale stored in checkpoints).

    A tensor divisor on purpose: CUDA turns division by a Python scalar into multiplication by its
    rounded reciprocal, which rounds differently from the true quotient that CPU computes.
    """
    amax = global_amax.to(torch.float32)
    return torch.div(amax, torch.full_like(amax, GLOBAL_SCALE_DIVISOR))
