"""The rotated code-word layout (``word_layout``): a bit permutation of each word that the rotated
PTX decodes to the natural layout's bf16x2 code registers, and its per-tensor cache."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.kernels import word_layout


def _words(count: int, seed: int) -> torch.Tensor:
    """Random int32 words plus the edge words (all zero, all one, each sign-bit pattern)."""
    g = torch.Generator().manual_seed(seed)
    edges = torch.tensor([0, -1, 2**31 - 1, -(2**31), 0x08888888, 0x77777777], dtype=torch.int32)
    return torch.cat([torch.randint(-(2**31), 2**31 - 1, (count,), dtype=torch.int32, generator=g), edges])


def test_every_bit_of_the_word_is_stored_once() -> None:
    assert sorted(word_layout.bit_sources()) == list(range(32))


def test_rotated_words_decode_to_the_natural_layouts_registers() -> None:
    words = _words(4000, seed=0)
    rotated = word_layout.rotated_words(words)
    assert rotated.dtype == torch.int32 and rotated.shape == words.shape
    for natural, stored in zip(words.tolist(), rotated.tolist(), strict=True):
        assert word_layout.decode_rotated_word(stored & 0xFFFFFFFF) == word_layout.decode_natural_word(natural & 0xFFFFFFFF)


def test_each_code_decodes_in_every_nibble() -> None:
    """Every code in every nibble, the other nibbles random: the pair register of its nibble holds
    the code's sign on bit 15 (+16) and ``e1 e0 m`` on bits 8..6 (+16)."""
    for nibble in range(8):
        for code in range(16):
            base = _words(8, seed=nibble * 16 + code) & ~(0xF << (4 * nibble))
            words = base | (code << (4 * nibble))
            for stored in word_layout.rotated_words(words).tolist():
                register = word_layout.decode_rotated_word(stored & 0xFFFFFFFF)[nibble % 4] >> (16 * (nibble // 4))
                assert register & 0xFFFF == ((code & 7) << 6) | ((code >> 3) << 15)


def test_the_natural_reference_is_the_natural_ptx() -> None:
    """``decode_natural_word`` is what ``_DEQUANT_WORD_PTX`` computes (and, multiply, and per pair)."""
    for word in (w & 0xFFFFFFFF for w in _words(2000, seed=1).tolist()):
        ptx = tuple(((src & mask) * mul) & 0x81C081C0 for src, mask, mul in
                    ((word, 0x000F000F, 4160), (word, 0x00F000F0, 260), (word >> 8, 0x000F000F, 4160),
                     (word >> 8, 0x00F000F0, 260)))
        assert ptx == word_layout.decode_natural_word(word)


def test_the_rotated_ptx_uses_the_layouts_rotations() -> None:
    ptx = word_layout.ROTATED_DEQUANT_WORD_PTX
    rotations = {int(line.rsplit(",", 1)[1].strip(" ;")) for line in ptx.splitlines() if line.startswith("shf.l.wrap")}
    assert rotations == {r for pair in word_layout.PAIR_ROTATIONS for r in pair} - {0}
    assert ptx.count("mul.rn.bf16x2") == 4


def test_cache_follows_in_place_writes() -> None:
    codes = torch.randint(0, 256, (3, 8, 16), dtype=torch.uint8)
    words = codes.view(torch.int32)
    first = word_layout.rotated_code_words(codes, words)
    assert word_layout.rotated_code_words(codes, words) is first
    codes[1].fill_(0x5A)  # a weight sync writes in place
    second = word_layout.rotated_code_words(codes, words)
    assert second is not first and torch.equal(second, word_layout.rotated_words(words))
    other = codes.clone()
    assert word_layout.rotated_code_words(other, other.view(torch.int32)) is not second


def test_rejects_other_dtypes() -> None:
    with pytest.raises(TypeError, match="int32 code words"):
        word_layout.rotated_words(torch.zeros(4, dtype=torch.int64))
