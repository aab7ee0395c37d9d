"""The NVFP4 format: E2M1 element codes, E4M3 block scales, and nibble packing.

An NVFP4 value is ``e2m1(code) * e4m3(block_scale) * global_decode_scale``. This module holds the
pieces of that product that do not depend on how a tensor is blocked: the E2M1 grid, the
round-to-nearest-even mapping from fp32 to codes, and the two-codes-per-byte packing.
"""

from __future__ import annotations

import functools

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
# codes 0, 2, 4, 6): ties at 0.25, 1.25, 2.5 and 5 stay down ("|v| > t" moves up), ties at 0.75,
# 1.75 and 3.5 go up ("|v| >= t" moves up). For floats, "|v| >= t" is "|v| > the float below t", so
# all seven become strict comparisons and one bucketize counts how many thresholds |v| passed.
_TIES_GO_UP = (0.75, 1.75, 3.5)
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _strict_thresholds(device: torch.device | str) -> torch.Tensor:
    t = torch.tensor(_THRESHOLDS, dtype=torch.float32, device=device)
    below = torch.nextafter(t, torch.tensor(float("-inf"), device=device))
    ties_up = torch.tensor([v in _TIES_GO_UP for v in _THRESHOLDS], device=device)
    return torch.where(ties_up, below, t)


def magnitude_index(scaled: torch.Tensor, use_bucketize: bool | None = None) -> torch.Tensor:
    """Index (uint8, 0..7) of the nearest-even E2M1 magnitude of fp32 ``|scaled|``, saturating at 6.

    One ``bucketize`` kernel on GPUs; seven fused comparisons on CPU, where they are faster. Both
    count the same strict comparisons, so they agree bit for bit (tested).
    """
    magnitude = scaled.abs()
    thresholds = _strict_thresholds(scaled.device)
    if use_bucketize is None:
        use_bucketize = scaled.is_cuda
    if use_bucketize:
        return torch.bucketize(magnitude, thresholds, right=False).to(torch.uint8)
    index = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for t in thresholds.tolist():
        index += magnitude > t
    return index


def e2m1_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 E2M1 values as fp32, indexed by code (codes 8..15 are the negatives of 0..7). One
    tensor per device, made on the first call: later calls copy nothing from the host, so a CUDA
    graph can capture code that decodes. Read it, never write it."""
    return _e2m1_lut(torch.device(device))


@functools.cache
def _e2m1_lut(device: torch.device) -> torch.Tensor:
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def round_to_e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes (uint8, 0..15): nearest-even, saturating at +-6.

    ``-0.0`` maps to code 0 and negative values in ``[-0.25, 0)`` to code 8 (negative zero), as in
    Transformer Engine's reference quantizer. NaN is not handled; callers reject it earlier.
    """
    index = magnitude_index(scaled)
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
