"""Code orders of NVFP4 code words: the same codes, placed so that Hopper dequantizes them in fewer instructions.

A code word (int32) holds 8 E2M1 codes, code ``i`` in bits ``4i .. 4i+3`` (sign in the top bit): the
plain order. The dequantization (:data:`~megatron_quads.kernels.w4a16._DEQUANT_WORD_PTX`) turns
codes ``q`` and ``q + 4`` into one bf16 pair whose 16-bit halves hold the code's magnitude at bits
6..8 and its sign at 15 (``e2m1 * 2^-126``) and multiplies it by the block scale pair. From the plain
order each pair takes a mask, a multiply by ``2^6 + 2^12`` (two shifts at once) and a mask: 17
instructions a word with the scale multiplies, 9 of them on the integer ALU pipe.

A code order places each pair's bits where one shift or rotation of the word brings them into
place, so that a shift and a mask do. Where a pair's sign bits cannot share its magnitudes' shift,
the signs are applied after the scale multiply, by an exclusive-or into the product's sign bits (the
product is magnitude times scale; negating it is exact, so the bits are the plain order's):

* ``CODE_ORDERS[1]`` (rotated): pair 0 as in the plain order, pairs 1 and 2 a left rotation by 27
  and 17 bits from their place, pair 3's magnitudes a rotation by 30, its signs in place: 14
  instructions a word, 9 on the ALU pipe (rotations are funnel shifts there);
* ``CODE_ORDERS[2]`` (balanced): pairs 0 and 1 a left shift by 6 and 3 bits from their place (an
  integer multiply, on the FMA pipe), pair 2's magnitudes in place and signs a shift by 4, pair 3's
  magnitudes a right shift by 7 and signs a left shift by 5: 15 instructions a word, 7 on the ALU
  pipe.

:func:`to_code_order` and :func:`from_code_order` convert code words (a permutation of each word's
bits), :func:`ordered_weight` an ``NVFP4Tensor``; :data:`DEQUANT_WORD_PTX` holds each order's
dequantization, which ``w4a16_ws`` runs with ``CODE_ORDER`` in its config.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_quads.nvfp4.tensor import NVFP4Tensor

PLAIN = 0

_ROTATED_PLACES = {  # (pair, high half) -> stored bits of (magnitude 0, 1, 2, sign)
    (0, 0): (0, 1, 2, 3), (0, 1): (16, 17, 18, 19),
    (1, 0): (11, 12, 13, 20), (1, 1): (27, 28, 29, 4),   # (target - 27) mod 32
    (2, 0): (21, 22, 23, 30), (2, 1): (5, 6, 7, 14),     # (target - 17) mod 32
    (3, 0): (8, 9, 10, 15), (3, 1): (24, 25, 26, 31),    # magnitudes (target - 30) mod 32, signs in place
}
_BALANCED_PLACES = {
    (0, 0): (0, 1, 2, 9), (0, 1): (16, 17, 18, 25),      # target - 6
    (1, 0): (3, 4, 5, 12), (1, 1): (19, 20, 21, 28),     # target - 3
    (2, 0): (6, 7, 8, 11), (2, 1): (22, 23, 24, 27),     # magnitudes in place, signs target - 4
    (3, 0): (13, 14, 15, 10), (3, 1): (29, 30, 31, 26),  # magnitudes target + 7, signs target - 5
}

_ROTATED_PTX = """
{
.reg .b32 a, r;
and.b32 a, $8, 0x000F000F;
mul.lo.u32 a, a, 4160;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$0, $1}, r;
shf.l.wrap.b32 a, $8, $8, 27;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$2, $3}, r;
shf.l.wrap.b32 a, $8, $8, 17;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$4, $5}, r;
shf.l.wrap.b32 a, $8, $8, 30;
and.b32 a, a, 0x01C001C0;
mul.rn.bf16x2 r, a, $9;
lop3.b32 r, r, $8, 0x80008000, 0x78;
mov.b32 {$6, $7}, r;
}
"""

_BALANCED_PTX = """
{
.reg .b32 a, b, r;
mul.lo.u32 a, $8, 64;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$0, $1}, r;
mul.lo.u32 a, $8, 8;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$2, $3}, r;
and.b32 a, $8, 0x01C001C0;
mul.rn.bf16x2 r, a, $9;
mul.lo.u32 b, $8, 16;
lop3.b32 r, r, b, 0x80008000, 0x78;
mov.b32 {$4, $5}, r;
shr.u32 a, $8, 7;
and.b32 a, a, 0x01C001C0;
mul.rn.bf16x2 r, a, $9;
mul.lo.u32 b, $8, 32;
lop3.b32 r, r, b, 0x80008000, 0x78;
mov.b32 {$6, $7}, r;
}
"""

CODE_ORDERS = {1: "rotated", 2: "balanced"}
"""The code orders besides the plain one (0), by the number a kernel config names them with."""

DEQUANT_WORD_PTX = {1: _ROTATED_PTX, 2: _BALANCED_PTX}
"""Per code order: a word in that order (``$8``) and a scale pair ``(s, s)`` (``$9``, bf16
``scale * 2^118``) to the 8 bf16 outputs the plain dequantization gives for the plain word (``lop3``
0x78: ``r ^ (b & 0x80008000)``)."""

_PLACES = {1: _ROTATED_PLACES, 2: _BALANCED_PLACES}


def bit_order(order: int) -> tuple[int, ...]:
    """``bit_order(order)[4 * code + bit]``: where plain bit ``bit`` (0-2 magnitude, 3 sign) of code
    ``code`` (0-7) of a word goes in code order ``order``."""
    if order not in _PLACES:
        raise ValueError(f"code order {order} is not one of {CODE_ORDERS} (0: the plain order)")
    places = _PLACES[order]
    return tuple(places[(code % 4, code // 4)][bit] for code in range(8) for bit in range(4))


for _order in _PLACES:
    assert sorted(bit_order(_order)) == list(range(32)), f"code order {_order} is a permutation of a word's bits"


def _permute_bits(words: torch.Tensor, destination: tuple[int, ...]) -> torch.Tensor:
    """``words`` (int32) with bit ``i`` of each moved to ``destination[i]``."""
    if words.dtype != torch.int32:
        raise TypeError(f"code words are int32 (8 E2M1 codes a word), got {words.dtype}")
    source = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(source)
    for bit, to in enumerate(destination):
        out |= ((source >> bit) & 1) << to
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def to_code_order(words: torch.Tensor, order: int) -> torch.Tensor:
    """Code words (int32, plain order) in code order ``order``."""
    return words if order == PLAIN else _permute_bits(words, bit_order(order))


def from_code_order(words: torch.Tensor, order: int) -> torch.Tensor:
    """Code words in code order ``order`` back in the plain order."""
    if order == PLAIN:
        return words
    inverse = [0] * 32
    for plain, placed in enumerate(bit_order(order)):
        inverse[placed] = plain
    return _permute_bits(words, tuple(inverse))


def ordered_weight(weight: NVFP4Tensor, order: int) -> NVFP4Tensor:
    """``weight`` with its code words (each 4 bytes of a row's packed codes) in code order ``order``:
    what a kernel launched with ``CODE_ORDER`` = ``order`` reads."""
    if weight.codes.shape[-1] % 4:
        raise ValueError(f"code words need rows of a multiple of 8 codes, got {2 * weight.codes.shape[-1]}")
    words = weight.codes.contiguous().view(torch.int32)
    return replace(weight, codes=to_code_order(words, order).view(torch.uint8))
