"""Triton device functions of the NVFP4 format, shared by every Triton kernel (imported only where
Triton is installed).

The fp32 operation order is :mod:`megatron_quads.nvfp4.quantize`'s (Transformer Engine's), and every
rounding step is a single IEEE operation or exact bit arithmetic: identical in the interpreter and
on the GPU, fused multiply-adds included. Nothing here casts to fp8 (the interpreter's fp8 casts do
not round like the GPU's).

* global scales: :func:`global_scales` (``S_enc``, ``S_dec``, ``weight_scale_2`` of an amax);
* E4M3 block scales: :func:`block_scale`, :func:`e4m3_round`, :func:`e4m3_to_f32`, and the
  per-block :func:`element_encode_scale`;
* E2M1 codes: :func:`e2m1_code`, :func:`e2m1_magnitude` (encode), :func:`e2m1_to_f32`,
  :func:`unpack_e2m1` (decode);
* outputs: :func:`round_f32_to` (fp32 to bf16 / fp16 / fp32, round to nearest even).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
"""Under Triton's interpreter (CPU): the GPU-only fast paths (inline PTX, ``cvt.rn``) are replaced
by bit arithmetic with the same results."""

FLT_MAX = tl.constexpr(3.4028234663852886e38)
E4M3_MAX = tl.constexpr(448.0)
RCP_6 = tl.constexpr(0.1666666716337204)
"""fp32(1/6), what ``torch.reciprocal(6.0)`` gives: ``S_enc / 6`` is ``S_enc * RCP_6``."""


# ----------------------------------------------------------------------------------------- scales


@triton.jit
def global_scales(amax):
    """``(S_enc, S_dec, weight_scale_2)`` of fp32 ``amax`` (a scalar or a tensor): ``S_enc =
    min(2688 / amax, FLT_MAX)`` (1 where that is 0, i.e. amax = inf), ``S_dec = 1 / S_enc`` and
    ``weight_scale_2 = amax / 2688``, all IEEE divisions (``div_rn``: Triton's ``/`` is approximate
    on the GPU)."""
    enc = tl.minimum(tl.math.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), FLT_MAX)
    enc = tl.where(enc == 0.0, 1.0, enc)
    dec = tl.math.div_rn(tl.full(enc.shape, 1.0, tl.float32), enc)
    decode = tl.math.div_rn(amax, tl.full(amax.shape, 2688.0, tl.float32))
    return enc, dec, decode


@triton.jit
def e4m3_round(s):
    """fp32 ``s`` in ``[0, 448]`` to float8_e4m3fn, round to nearest even: ``(byte int32, value fp32)``.

    From 2^-6 up the fp32 mantissa is rounded to 3 bits on the bits (a carry may bump the exponent).
    Below, values are ``k * 2^-9`` with ``k = rne(s * 2^9)`` in 0..8, read off the bits of
    ``s * 2^9 + 2^23`` (exact product, one rounding); byte ``k`` encodes exactly that value.
    """
    b = s.to(tl.int32, bitcast=True)
    normal_bits = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576  # clear the 20 dropped mantissa bits
    magic = s * 512.0 + 8388608.0
    is_normal = b >= 0x3C800000  # 2^-6
    byte = tl.where(is_normal, (normal_bits >> 20) - 960, magic.to(tl.int32, bitcast=True) - 0x4B000000)
    value = tl.where(is_normal, normal_bits.to(tl.float32, bitcast=True), (magic - 8388608.0) * 0.001953125)
    return byte, value  # 960 = (127 - 7) << 3 rebiases the exponent


@triton.jit
def block_scale(block_amax, encode_div6):
    """The E4M3 scale of blocks with amax ``block_amax`` (>= 0): ``e4m3(min(block_amax * (S_enc / 6),
    448))`` with ``encode_div6 = S_enc * RCP_6``, as ``(byte int32, value fp32)``. (The reference's
    lower clamp at -448 never acts: both factors are >= 0.)"""
    return e4m3_round(tl.minimum(block_amax * encode_div6, E4M3_MAX))


@triton.jit
def element_encode_scale(scale, dec):
    """The factor a block's elements are multiplied by before E2M1 rounding:
    ``min(1 / (scale * S_dec), FLT_MAX)`` (an IEEE division)."""
    prod = scale * dec
    return tl.minimum(tl.math.div_rn(tl.full(prod.shape, 1.0, tl.float32), prod), FLT_MAX)


@triton.jit
def e4m3_to_f32(scale_bytes, LOG2_FACTOR: tl.constexpr = 0):
    """E4M3 bytes (an integer tensor, 0..255) to fp32 ``value * 2^LOG2_FACTOR``, exactly (NaN is not
    special-cased).

    The 7 magnitude bits become an fp16 exponent/mantissa (value ``* 2^-8``, E4M3 subnormals landing
    on fp16 subnormals) that is widened to fp32 and rescaled: no fp8 cast, exact everywhere.
    """
    b = scale_bytes.to(tl.int16)
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * (2.0 ** (LOG2_FACTOR + 8))


# ----------------------------------------------------------------------------------------- E2M1


@triton.jit
def _e2m1_round(v):
    """Round fp32 ``v`` to E2M1 (nearest even, saturating at 6): ``(t, negative)`` with
    ``t = 2^23 + magnitude index`` (fp32) and ``negative = v < 0`` (the sign bit of the code).

    On ``a = min(|v|, 6)`` the index is ``rne(f(a))`` for the concave piecewise-linear
    ``f(a) = min(2a, a + 2, a/2 + 4)`` (the grid is evenly spaced below 2, from 2 to 4 and above 4);
    index parity follows code parity, so half-even rounding reproduces the format's ties (0.25,
    1.25, 2.5, 5 round down; 0.75, 1.75, 3.5 up). Each piece is rounded once, at 2^23 where the fp32
    spacing is 1 (``a * m`` is exact, so fused or not the add rounds once); ``rne`` is monotone, so
    it commutes with ``min``.
    """
    a = tl.minimum(tl.abs(v), 6.0)
    t = tl.minimum(tl.minimum(a * 2.0 + 8388608.0, a + 8388610.0), a * 0.5 + 8388612.0)
    return t, v < 0.0


@triton.jit
def e2m1_code(v):
    """E2M1 code (int32, 0..15, bit 3 = sign) of fp32 ``v``: nearest even with the ties of
    :mod:`megatron_quads.nvfp4.format`, saturating at 6; ``-0.0`` gives code 0."""
    t, negative = _e2m1_round(v)
    return t.to(tl.int32, bitcast=True) - tl.where(negative, 0x4B000000 - 8, 0x4B000000)  # 2^23's bits


@triton.jit
def e2m1_magnitude(v):
    """The E2M1 magnitude (fp32) that ``|v|`` rounds to (nearest even, saturating at 6).

    On ``a = min(|v|, 6)`` the grid spacing is 0.5 below 2, 1 from 2 to 4 and 2 from 4, the fp32
    spacing at ``M = 2^22, 2^23, 2^24``: ``(a + M) - M`` rounds ``a`` to the grid in one IEEE add,
    half to even (the ties land as in :func:`e2m1_code`): ``M = 2^22 * max(2^floor(log2 a), 1)``.
    """
    a = tl.minimum(tl.abs(v), 6.0)
    m = (tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000) + (22 << 23)).to(tl.float32, bitcast=True)
    return (a + m) - m


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


# ----------------------------------------------------------------------------------------- outputs


@triton.jit
def round_f32_to(v, DTYPE: tl.constexpr):
    """fp32 to ``DTYPE`` with round-to-nearest-even. Under the interpreter bf16 goes by bit arithmetic,
    because its fp32 -> bf16 cast truncates; on the GPU the cast is one ``cvt.rn`` per two values."""
    if INTERPRET and DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        # NaN -> quiet NaN first: the NaN 0x7FFFFFFF would carry into the sign bit
        bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, bits)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(DTYPE)
    return out
