"""The rule for the NVFP4 scales a checkpoint stores, as every loader applies it (the project's
checkpoint reader and the vLLM plugin): elementwise masks of the values that are not a valid scale.

- block scales (``weight_scale``, ``residual_weight_scale``; float8_e4m3fn): finite and >= 0, i.e.
  no NaN byte (0x7F / 0xFF) and no sign bit;
- decode scales (``weight_scale_2``; float32): finite and >= 0, and 0 only for a weight whose block
  scales are all 0 (an all-zero weight, which the quantizer stores with ``weight_scale_2 = 0``): a
  0 beside non-zero block scales would decode the weight to zeros;
- static input scales (``input_scale``; float32): finite and > 0.
"""

from __future__ import annotations

import torch


def invalid_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """Mask of the E4M3 block scales in ``scales`` that are NaN (bytes 0x7F / 0xFF) or carry a sign bit."""
    codes = scales.view(torch.uint8)
    return (codes & 0x80).ne(0) | (codes & 0x7F).eq(0x7F)


def invalid_decode_scales(scale_2: torch.Tensor, weight_nonzero: torch.Tensor) -> torch.Tensor:
    """Mask of the decode scales in ``scale_2`` that are NaN, Inf or negative, or 0 where
    ``weight_nonzero`` (same shape) says the weight's block scales are not all 0."""
    return ~torch.isfinite(scale_2) | (scale_2 < 0) | ((scale_2 == 0) & weight_nonzero)


def invalid_input_scales(input_scale: torch.Tensor) -> torch.Tensor:
    """Mask of the static input scales in ``input_scale`` that are not finite and > 0."""
    return ~(torch.isfinite(input_scale) & (input_scale > 0))
