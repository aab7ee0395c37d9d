"""The NVFP4 format: E2M1 element codes, E4M3 block scales, and nibble packing.

An NVFP4 value is ``e2m1(code) * e4m3(block_scale) * global_decode_scale``. This module holds the
pieces of that product that do not depend on how a tensor is blocked: the E2M1 grid, the
round-to-nearest-even mapping from fp32 to codes, and the two-codes-per-byte packing.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 16
"""Elements per block along the last dimension (NVFP4 uses 1x16 blocks)."""

FP4_MAX = 6.0
"""Largest E2M1 magnitude."""

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn magnitude."""

GLOBAL_SCALE_DIVISOR = FP8_E4M3_MAX * FP4_MAX
"""2688 = 448 * 6: ``weight_scale_2 = global_amax / 2688`` (the ModelOpt / vLLM convention)."""

FLOAT32_MAX = torch.finfo(torch.float32).max

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitudes indexed by the low three bits of a code; bit 3 is the sign."""

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Decision thresholds on |v| between neighbouring magnitudes. A value exactly on a threshold is a
# tie; round-to-nearest-even sends it to the magnitude whose code is even (0, 1.0, 2.0, 4.0, 6.0 for
# codes 0, 2, 4, 6), so the comparison is strict (">") where the lower code is even and ">=" where
# the lower code is odd.
_STRICT_THRESHOLDS = (0.25, 1.25, 2.5, 5.0)  # lower neighbour has an even code: ties stay down
_INCLUSIVE_THRESHOLDS = (0.75, 1.75, 3.5)  # lower neighbour has an odd code: ties go up


def e2m1_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 E2M1 values as fp32, indexed by code (codes 8..15 are the negatives of 0..7)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def round_to_e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes (uint8, 0..15): nearest-even, saturating at +-6.

    ``-0.0`` maps to code 0 and negative values in ``[-0.25, 0)`` to code 8 (negative zero), as in
    Transformer Engine's reference quantizer. NaN is not handled; callers reject it earlier.
    """
    magnitude = scaled.abs()
    index = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for threshold in _STRICT_THRESHOLDS:
        index += magnitude > threshold
    for threshold in _INCLUSIVE_THRESHOLDS:
        index += magnitude >= threshold
    sign = (scaled < 0).to(torch.uint8) << 3
    return index | sign


def codes_to_values(codes: torch.Tensor) -> torch.Tensor:
    """Map unpacked E2M1 codes (uint8, 0..15) to their fp32 values."""
    return e2m1_lut(codes.device)[codes.long()]


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes two per byte along the last dim: element 2i in the low nibble, 2i+1 in the high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_codes needs an even last dimension, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 [..., K/2] -> codes uint8 [..., K]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype} for shape {tuple(packed.shape)}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)
