"""A bit layout of the packed E2M1 code words that dequantizes in fewer instructions.

The kernels read 8 codes as one 32-bit word (nibble ``q`` at bits ``4q..4q+3``: ``m e0 e1 s`` from
the low bit) and turn nibbles ``q`` and ``q + 4`` into one bf16x2 register whose halves hold
``e1 e0 m`` on bits 8..6 and the sign on bit 15 (the bf16 code ``* 2^-126``, then one multiply by the
scale pair). In the natural layout that takes an and, an integer multiply and an and per pair, plus
a shift per word (:data:`~megatron_quads.kernels.w4a16._DEQUANT_WORD_PTX`: 13 integer
instructions a word). Those eight target bits ``T = {6, 7, 8, 15, 22, 23, 24, 31}`` can instead be
stored where one rotate puts them:

* pair 0 in place (an and),
* pair 1 rotated right by 4, pair 2 by 10 (a rotate and an and each),
* pair 3: its ``m, e0, s`` rotated right by 6 and its ``e1`` by 14 (two rotates, an and, a lop3):

9 integer instructions a word. No rotation set tiles the word with four copies of ``T`` (checked
exhaustively over 32 and 64-bit funnel shifts), so one pair needs two. :func:`rotated_words` rewrites
words into this layout once (at weight load); :data:`ROTATED_DEQUANT_WORD_PTX` decodes them to the
same bf16x2 values, in the same output order, as the natural layout's PTX.
"""

from __future__ import annotations

import functools

import torch

from megatron_quads.kernels.derived import derived_tensor

_ROLE_TARGETS = (6, 7, 8, 15)
"""bf16 bit of the low half that each nibble bit (``m, e0, e1, s``) lands on (the high half: + 16)."""

PAIR_ROTATIONS = ((0, 0, 0, 0), (4, 4, 4, 4), (10, 10, 10, 10), (6, 6, 14, 6))
"""Left rotation that brings each bit (``m, e0, e1, s``) of pair ``q``'s nibbles to its target."""

TARGET_MASK = 0x81C081C0
"""The bf16x2 bits a pair occupies after its rotation."""


@functools.cache
def bit_sources() -> tuple[int, ...]:
    """``sources[p]``: the natural-layout bit stored at bit ``p`` of a rotated word."""
    sources = [-1] * 32
    for pair, rotations in enumerate(PAIR_ROTATIONS):
        for half, nibble in ((0, pair), (1, pair + 4)):
            for role, (target, rotation) in enumerate(zip(_ROLE_TARGETS, rotations, strict=True)):
                stored = (target + 16 * half - rotation) % 32
                if sources[stored] != -1:
                    raise AssertionError(f"bit {stored} stored twice")
                sources[stored] = 4 * nibble + role
    return tuple(sources)


@functools.cache
def _byte_tables(device: torch.device) -> torch.Tensor:
    """``tables[b, v]``: the rotated word's bits contributed by value ``v`` of natural byte ``b``."""
    sources = bit_sources()
    tables = torch.zeros(4, 256, dtype=torch.int64)
    values = torch.arange(256, dtype=torch.int64)
    for stored, source in enumerate(sources):
        byte, bit = divmod(source, 8)
        tables[byte] |= ((values >> bit) & 1) << stored
    return tables.to(device)


def rotated_words(words: torch.Tensor) -> torch.Tensor:
    """Natural-layout int32 code words (any shape) rewritten into the rotated layout (new tensor,
    same shape and device): a bit permutation inside each word, by four byte lookups."""
    if words.dtype != torch.int32:
        raise TypeError(f"rotated_words takes int32 code words (codes.view(torch.int32)), got {words.dtype}")
    tables = _byte_tables(words.device)
    natural = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(natural)
    for byte in range(4):
        out |= tables[byte][(natural >> (8 * byte)) & 0xFF]
    return (out - ((out >> 31) << 32)).to(torch.int32)  # back to the signed 32-bit view


def rotated_code_words(codes: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """:func:`rotated_words` of ``words`` (the int32 view of ``codes``), computed once per ``codes``
    tensor and kept while it lives (:func:`~megatron_quads.kernels.derived.derived_tensor`:
    rebuilt after an in-place write such as a weight sync). ``codes`` keys the cache (the kernels'
    word views are new tensors each call); the caller makes ``words`` (``w4a16._code_words``, which
    this Triton-free module does not import)."""
    return derived_tensor(codes, "rotated code words", lambda: rotated_words(words))


def _rotl(value: int, amount: int) -> int:
    return ((value << amount) | (value >> (32 - amount))) & 0xFFFFFFFF if amount else value


def decode_rotated_word(word: int) -> tuple[int, int, int, int]:
    """What :data:`ROTATED_DEQUANT_WORD_PTX` computes before the scale multiply, in Python: the four
    bf16x2 code registers (pairs 0..3) of an unsigned 32-bit rotated word."""
    pair3 = (_rotl(word, 6) & 0x80C080C0) | (_rotl(word, 14) & 0x01000100)
    return word & TARGET_MASK, _rotl(word, 4) & TARGET_MASK, _rotl(word, 10) & TARGET_MASK, pair3


def decode_natural_word(word: int) -> tuple[int, int, int, int]:
    """The natural layout's four bf16x2 code registers of an unsigned 32-bit word (its PTX's and,
    multiply, and), the reference for :func:`decode_rotated_word`."""
    out = []
    for pair in range(4):
        bits = 0
        for half, nibble in ((0, pair), (1, pair + 4)):
            code = (word >> (4 * nibble)) & 0xF
            bits |= (((code & 0x7) << 6) | ((code >> 3) << 15)) << (16 * half)
        out.append(bits)
    return tuple(out)


# Per rotated word and a bf16x2 scale pair: the same four bf16x2 results as _DEQUANT_WORD_PTX on the
# natural word. shf.l.wrap with both sources the word is a rotate; lop3 0xEA is (a & b) | c.
ROTATED_DEQUANT_WORD_PTX = """
{
.reg .b32 a, b, r;
and.b32 a, $8, 0x81C081C0;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$0, $1}, r;
shf.l.wrap.b32 a, $8, $8, 4;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$2, $3}, r;
shf.l.wrap.b32 a, $8, $8, 10;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$4, $5}, r;
shf.l.wrap.b32 a, $8, $8, 6;
shf.l.wrap.b32 b, $8, $8, 14;
and.b32 b, b, 0x01000100;
lop3.b32 a, a, 0x80C080C0, b, 0xEA;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$6, $7}, r;
}
"""
