"""Triton device functions shared by the NVFP4 kernels (imported only where Triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e2m1_to_f32(nibble):
    """E2M1 codes (int32 tensor, 0..15, bit 3 = sign) to their exact fp32 values.

    Built from bits, so it is exact in the interpreter and on the GPU alike: magnitude index
    ``(e, m)`` is ``2^(e-1) * (1 + m/2)`` for ``e > 0`` and ``m/2`` for ``e = 0``.
    """
    mag = nibble & 7
    e = mag >> 1
    m = mag & 1
    normal = ((e + 126) << 23) | (m << 22)
    bits = tl.where(e > 0, normal, m * 0x3F000000)
    bits = bits | ((nibble & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def unpack_e2m1(packed):
    """Packed bytes (uint8 tensor ``[..., K/2]``) to fp32 code values ``(low, high)``.

    Element ``2i`` of a row is the low nibble of byte ``i`` and ``2i+1`` the high one (the layout of
    :func:`megatron_quads.nvfp4.format.pack_codes`); interleave with ``tl.join(low, high)``.
    """
    p = packed.to(tl.int32)
    return e2m1_to_f32(p & 15), e2m1_to_f32(p >> 4)
