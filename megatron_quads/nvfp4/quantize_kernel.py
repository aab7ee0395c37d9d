"""Triton NVFP4 quantize and fake-quant kernels, bit-identical to :mod:`megatron_quads.nvfp4.quantize`.

Every kernel follows the reference's fp32 operation order (which is Transformer Engine's), through
the format's device functions (:mod:`megatron_quads.nvfp4.triton_codec`):

* ``S_enc = min(2688 / amax, FLT_MAX)`` (1 where it is 0) and ``S_dec = 1 / S_enc``, both IEEE
  divisions (``div_rn``: Triton's ``/`` is approximate on the GPU);
* ``scale = e4m3(min(block_amax * (S_enc * fp32(1/6)), 448))``, rounded to nearest even with bit
  arithmetic (the interpreter's fp8 casts do not round like the GPU's);
* ``element_encode = min(1 / (scale * S_dec), FLT_MAX)`` and ``code = e2m1(x * element_encode)``
  with the ties of :mod:`megatron_quads.nvfp4.format`.

Every rounding step is a single IEEE operation or exact bit arithmetic, identical in the
interpreter and on the GPU, fused multiply-adds included. The kernels read rows as words of two
elements (int32 for 16-bit dtypes, int64 for fp32): a tile of ROWS rows by NB blocks of 16 is
``[ROWS, NB, 8]`` words, and the even / odd elements of a word are the low / high nibbles of one code
byte, at the same offset. On the GPU, 16-bit outputs are converted with ``cvt.rn`` (round to nearest
even) instead of the bit arithmetic the interpreter needs.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from megatron_quads.nvfp4.format import BLOCK_SIZE, SUPPORTED_DTYPES
from megatron_quads.nvfp4.global_scale import AmaxLike, decode_scale_from_amax, global_amax_tensor
from megatron_quads.nvfp4.tensor import NVFP4Tensor
from megatron_quads.nvfp4.triton_codec import (
    INTERPRET,
    RCP_6,
    block_scale,
    e2m1_code,
    e2m1_magnitude,
    element_encode_scale,
    global_scales,
    round_f32_to,
)
from megatron_quads.nvfp4.validation import validate_input

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_AMAX_BLOCK = 4096
_M_BUCKET_CAP = 1 << 14


# ----------------------------------------------------------------------------------------- device math


@triton.jit
def _broadcast_rows(enc_s, dec_s, decode_s, ROWS: tl.constexpr):
    """Scalar ``(S_enc, S_dec, weight_scale_2)`` as ``[ROWS]`` tensors."""
    zeros = tl.zeros([ROWS], tl.float32)  # all three are > 0 or +0, so adding +0 keeps every bit
    return enc_s + zeros, dec_s + zeros, decode_s + zeros


@triton.jit
def _table_scales(amax_ptr, rows, row_mask, amax_div):
    """``(S_enc, S_dec, weight_scale_2)`` of row ``r``'s amax ``amax[r // amax_div]`` (``amax_div >= 1``)."""
    if amax_div == 1:
        index = rows
    else:
        index = rows // amax_div
    return global_scales(tl.load(amax_ptr + index, mask=row_mask, other=1.0))


@triton.jit
def _tile_rows(row_tile, mat_rows, ROWS: tl.constexpr, BLOCK_2D: tl.constexpr):
    """Rows ``[ROWS]`` of row tile ``row_tile`` and their mask. With ``BLOCK_2D`` row tiles stay
    inside one matrix of ``mat_rows`` rows (the matrices of a stack are quantized independently);
    otherwise ``mat_rows`` is the total row count."""
    if BLOCK_2D:
        tiles_per_mat = tl.cdiv(mat_rows, ROWS)
        local = (row_tile % tiles_per_mat) * ROWS + tl.arange(0, ROWS)
        row_mask = local < mat_rows
        rows = (row_tile // tiles_per_mat) * mat_rows + local
    else:
        rows = row_tile * ROWS + tl.arange(0, ROWS)
        row_mask = rows < mat_rows
    return rows, row_mask


@triton.jit
def _words_to_f32(w, IS_BF16: tl.constexpr):
    """Words of two elements to fp32 ``(even, odd)``: int64 words hold two fp32, int32 words two
    bf16 (``IS_BF16``) or two fp16. Bit arithmetic where it matters: the interpreter's own bf16
    conversion mishandles subnormals."""
    if w.dtype == tl.int64:
        even = w.to(tl.int32).to(tl.float32, bitcast=True)
        odd = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    elif IS_BF16:
        even = (w << 16).to(tl.float32, bitcast=True)
        odd = (w & -65536).to(tl.float32, bitcast=True)
    else:
        even = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit
def _f32_bits16(v, IS_BF16: tl.constexpr):
    """fp32 to bf16 / fp16 bits in the low half of an int32 (:func:`round_f32_to`: nearest even)."""
    return round_f32_to(v, tl.bfloat16 if IS_BF16 else tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _f32_to_words(even, odd, WORD: tl.constexpr, IS_BF16: tl.constexpr):
    """Inverse of :func:`_words_to_f32`, rounding to the 16-bit dtype when the words are int32."""
    if WORD == tl.int64:
        lo = even.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        words = lo | (odd.to(tl.int32, bitcast=True).to(tl.int64) << 32)
    elif not INTERPRET:
        # one packing conversion per word (Triton would emit a slower scalar cvt per element); the
        # first source goes to the high half
        cvt: tl.constexpr = "cvt.rn.bf16x2.f32 $0, $1, $2;" if IS_BF16 else "cvt.rn.f16x2.f32 $0, $1, $2;"
        words = tl.inline_asm_elementwise(cvt, "=r,f,f", [odd, even], dtype=tl.int32, is_pure=True, pack=1)
    else:
        words = _f32_bits16(even, IS_BF16) | (_f32_bits16(odd, IS_BF16) << 16)
    return words


@triton.jit
def _to_f32(x):
    """Loaded values to fp32; int16 holds bf16 bits (see :func:`_words_to_f32`)."""
    if x.dtype == tl.int16:
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _load_words(w_ptr, rows, row_mask, blocks, KB, EVICT: tl.constexpr):
    """Words ``[ROWS, NB, 8]`` of ``blocks`` (16-element blocks) of ``rows``, zeros outside, with their
    offsets and mask. ``KB`` is the number of blocks per row (K / 16): a row is ``8 * KB`` words,
    which also tells the compiler that every block starts 32-byte aligned.
    """
    offsets = (rows.to(tl.int64) * (KB * 8))[:, None, None] + (blocks * 8)[None, :, None] + tl.arange(0, 8)[None, None, :]
    mask = (row_mask[:, None] & (blocks < KB)[None, :])[:, :, None]
    return tl.load(w_ptr + offsets, mask=mask, other=0, eviction_policy=EVICT), offsets, mask


@triton.jit
def _load_halves(w_ptr, rows, row_mask, blocks, KB, EVICT: tl.constexpr):
    """The words of :func:`_load_words` as two ``[ROWS, NB, 4]`` tensors: the first and the second
    half of each block (elements 0..7 and 8..15).

    Two 16-byte loads a block whose results share one layout, so a thread holds whole blocks: the
    block amax needs no exchange between lanes and each block's scale (an e4m3 rounding and an IEEE
    division) is computed once, not once per lane holding a part of it. Both loads touch the same
    32-byte sectors, so DRAM still reads each byte once.

    The loads are built block-major ``[NB, ROWS, 4]`` and permuted: Triton's coalescing then puts the
    lanes along a row's blocks (a warp reads 512 bytes or more of one or two rows), where on
    ``[ROWS, NB, 4]`` it put them down the rows first (16 rows x 64 bytes a warp on 16-row tiles),
    which the ``quantize_tiles`` sweep measured slower.
    """
    first = (blocks * 8)[:, None, None] + (rows.to(tl.int64) * (KB * 8))[None, :, None] + tl.arange(0, 4)[None, None, :]
    mask = ((blocks < KB)[:, None] & row_mask[None, :])[:, :, None]
    low = tl.load(w_ptr + first, mask=mask, other=0, eviction_policy=EVICT)
    high = tl.load(w_ptr + (first + 4), mask=mask, other=0, eviction_policy=EVICT)
    return tl.permute(low, (1, 0, 2)), tl.permute(high, (1, 0, 2))


@triton.jit
def _pair_amax(even, odd):
    """``max |x|`` over the last axis of fp32 element pairs ``[ROWS, NB, n]``: ``[ROWS, NB]``."""
    return tl.max(tl.maximum(tl.abs(even), tl.abs(odd)), axis=2)


@triton.jit
def _halves_to_f32(low, high, IS_BF16: tl.constexpr):
    """Half-block words of :func:`_load_halves` to fp32 pairs and the block amax:
    ``(low_even, low_odd, high_even, high_odd, block amax [ROWS, NB])``."""
    low_even, low_odd = _words_to_f32(low, IS_BF16)
    high_even, high_odd = _words_to_f32(high, IS_BF16)
    block_amax = tl.maximum(_pair_amax(low_even, low_odd), _pair_amax(high_even, high_odd))
    return low_even, low_odd, high_even, high_odd, block_amax


@triton.jit
def _block_encode(even, odd, enc, dec, ROWS: tl.constexpr, NB: tl.constexpr, BLOCK_2D: tl.constexpr):
    """Block scales of fp32 element pairs ``[ROWS, NB, 8]`` (16-element blocks): :func:`_block_scales`."""
    return _block_scales(_pair_amax(even, odd), enc, dec, ROWS, NB, BLOCK_2D)


@triton.jit
def _block_scales(block_amax, enc, dec, ROWS: tl.constexpr, NB: tl.constexpr, BLOCK_2D: tl.constexpr):
    """Block scales from the block amax ``[ROWS, NB]`` with per-row ``S_enc`` and ``S_dec`` ``[ROWS]``:
    ``(element encode scale [ROWS, NB, 1], scale bytes, fp32 scales [ROWS, NB])``. With ``BLOCK_2D``
    the block amax is taken over 16-row groups (ROWS % 16 == 0).
    """
    if BLOCK_2D:
        tile_amax = tl.max(tl.reshape(block_amax, [ROWS // 16, 16, NB]), axis=1)
        block_amax = tl.reshape(tl.broadcast_to(tile_amax[:, None, :], [ROWS // 16, 16, NB]), [ROWS, NB])
    byte, scale = block_scale(block_amax, (enc * RCP_6)[:, None])
    return element_encode_scale(scale, dec[:, None])[:, :, None], byte, scale


@triton.jit
def _tile_scales(block_amax, enc, dec, ROWS: tl.constexpr, NB: tl.constexpr):
    """:func:`_block_scales` for 16x16 tiles whose 16 rows share ``S_enc`` / ``S_dec``: each tile's scale
    and encode scale computed once (from its first row's ``S_enc`` / ``S_dec``, always a real row) and
    broadcast to its rows, not once per row; the same values bit for bit."""
    R16: tl.constexpr = ROWS // 16
    tile_amax = tl.max(tl.reshape(block_amax, [R16, 16, NB]), axis=1)  # [R16, NB]
    first = (tl.arange(0, 16) == 0)[None, :]
    enc_t = tl.sum(tl.where(first, tl.reshape(enc, [R16, 16]), 0.0), axis=1)  # + zeros: the first row's bits
    dec_t = tl.sum(tl.where(first, tl.reshape(dec, [R16, 16]), 0.0), axis=1)
    byte, scale = block_scale(tile_amax, (enc_t * RCP_6)[:, None])
    element_encode = element_encode_scale(scale, dec_t[:, None])
    return (_each_tile_row(element_encode, ROWS, NB)[:, :, None], _each_tile_row(byte, ROWS, NB),
            _each_tile_row(scale, ROWS, NB))


@triton.jit
def _each_tile_row(v, ROWS: tl.constexpr, NB: tl.constexpr):
    """Per-tile values ``[ROWS / 16, NB]`` repeated for each of a tile's 16 rows: ``[ROWS, NB]``."""
    return tl.reshape(tl.broadcast_to(v[:, None, :], [ROWS // 16, 16, NB]), [ROWS, NB])


@triton.jit
def _scale_pairs(even, odd, enc, dec, ROWS: tl.constexpr, NB: tl.constexpr, BLOCK_2D: tl.constexpr):
    """:func:`_block_encode`, then the even and odd elements times their block's element encode scale
    (ready for E2M1 rounding): ``(scaled even, scaled odd, scale bytes, fp32 scales)``."""
    element_encode, byte, scale = _block_encode(even, odd, enc, dec, ROWS, NB, BLOCK_2D)
    return even * element_encode, odd * element_encode, byte, scale


# One E2M1 code per element in fp32: ``2^23 + code`` (code 0..15) from ``v = x * encode``, as in
# :func:`~megatron_quads.nvfp4.triton_codec.e2m1_code` (three pieces, two mins, after the clamp at 6), plus 8 when ``v < 0`` (set gives 1.0).
_CODE_PTX = """
mul.rn.f32 v, {x}, {e};
abs.f32 a, v;
min.f32 a, a, 0f40C00000;
fma.rn.f32 p, a, 0f40000000, 0f4B000000;
add.rn.f32 q, a, 0f4B000002;
min.f32 p, p, q;
fma.rn.f32 q, a, 0f3F000000, 0f4B000004;
min.f32 p, p, q;
set.lt.f32.f32 s, v, 0f00000000;
fma.rn.f32 {out}, s, 0f41000000, p;
"""
# Four words of a half block (even elements $4..$7, odd $8..$11, encode scales $12..$15) to one int32
# of 8 codes, nibble i = code of element i (even j, odd j = elements 2j, 2j + 1): the code bits are
# 0x4B000000 + code, so the sum of bits(t_i) * 16^i wraps to the packed codes plus the 0x4B000000
# of t_0 and 0x4B000000 * 16 = 0xB0000000 of t_1 (mod 2^32; the later ones shift out): one
# multiply-add per code and one add of 0x05000000 = -(0x4B000000 + 0xB0000000). $1..$3 are unused.
_CODE_WORD_PTX = tl.constexpr(
    "{\n.reg .f32 v, a, p, q, s;\n.reg .b32 w, t0, t1, t2, t3, t4, t5, t6, t7;"
    + "".join(_CODE_PTX.format(x=f"${4 + j}", e=f"${12 + j}", out=f"t{2 * j}") for j in range(4))
    + "".join(_CODE_PTX.format(x=f"${8 + j}", e=f"${12 + j}", out=f"t{2 * j + 1}") for j in range(4))
    + "mov.b32 w, t7;\n"
    + "".join(f"mad.lo.u32 w, w, 16, t{i};\n" for i in range(6, -1, -1))
    + "add.u32 $0, w, 0x05000000;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n}"
)


@triton.jit
def _pack_codes(even, odd, element_encode, ROWS: tl.constexpr, NB: tl.constexpr, FAST: tl.constexpr):
    """E2M1 codes of the fp32 element pairs of half blocks ``[ROWS, NB, 4]`` scaled by
    ``element_encode [ROWS, NB, 1]``, packed as one int32 word per half block ``[ROWS, NB]`` (byte
    ``j`` holds elements ``2j`` and ``2j + 1``, low nibble first).

    ``FAST`` (16-bit inputs on the GPU: each thread holds the 4 words of a half block) runs
    :data:`_CODE_WORD_PTX` on each; otherwise the codes are built with Triton arithmetic.
    """
    if FAST:
        encode = tl.broadcast_to(element_encode, even.shape)
        packed = tl.inline_asm_elementwise(
            _CODE_WORD_PTX, "=r,=r,=r,=r,f,f,f,f,f,f,f,f,f,f,f,f", [even, odd, encode],
            dtype=tl.int32, is_pure=True, pack=4,
        )
        # the word of each run of 4 is its first element
        first, _ = tl.split(tl.reshape(packed, [ROWS, NB, 2, 2]))
        word, _ = tl.split(first)
    else:
        code_even = e2m1_code(even * element_encode)
        code_odd = e2m1_code(odd * element_encode)
        shifts = (tl.arange(0, 4) * 8)[None, None, :]
        word = tl.sum((code_even | (code_odd << 4)) << shifts, axis=2)  # the bytes do not overlap: the sum is their OR
    return word


@triton.jit
def _store_as_laid_out(ptrs, values, mask, FAST: tl.constexpr):
    """``tl.store``, except that with ``FAST`` every thread writes the elements it holds with its own
    ``st.global`` (no layout conversion through shared memory: adjacent lanes hold adjacent words here,
    so the stores coalesce as they are; threads holding the same element write the same value)."""
    if FAST:
        if values.dtype == tl.int32:
            asm: tl.constexpr = "{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n@p st.global.b32 [$1], $2;\nmov.b32 $0, 0;\n}"
        else:
            asm: tl.constexpr = "{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n@p st.global.b8 [$1], $2;\nmov.b32 $0, 0;\n}"
        tl.inline_asm_elementwise(asm, "=r,l,r,r", [ptrs, values.to(tl.int32), mask.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def _store_quantized(code_words_ptr, scales_ptr, words, byte, rows, row_mask, blocks, KB, FAST: tl.constexpr):
    """Code words ``[ROWS, NB, 2]`` (``code_words_ptr``: the codes viewed as int32, a row is ``2 * KB``
    words) and scale bytes ``[ROWS, NB]`` at ``rows * KB + blocks``."""
    smask = row_mask[:, None] & (blocks < KB)[None, :]
    offsets = (rows.to(tl.int64) * (KB * 2))[:, None, None] + (blocks * 2)[None, :, None] + tl.arange(0, 2)[None, None, :]
    _store_as_laid_out(code_words_ptr + offsets, words, tl.broadcast_to(smask[:, :, None], offsets.shape), FAST)
    _store_as_laid_out(scales_ptr + rows.to(tl.int64)[:, None] * KB + blocks[None, :], byte.to(tl.uint8), smask, FAST)


@triton.jit
def _quantize_tile(code_words_ptr, scales_ptr, low, high, enc, dec, rows, row_mask, blocks, KB,
                   ROWS: tl.constexpr, NB: tl.constexpr, BLOCK_2D: tl.constexpr, IS_BF16: tl.constexpr,
                   FAST_MAX_ROWS: tl.constexpr, TILE_SCALES: tl.constexpr = False):
    """Quantize the half-block words ``[ROWS, NB, 4]`` of :func:`_load_halves` with per-row ``S_enc`` /
    ``S_dec`` and store codes and scales; tiles of at most ``FAST_MAX_ROWS`` rows take the PTX codes
    and direct stores (:func:`_pack_codes`, :func:`_store_as_laid_out`). ``TILE_SCALES`` (2D, rows of
    a tile sharing their scales): :func:`_tile_scales`."""
    low_even, low_odd, high_even, high_odd, block_amax = _halves_to_f32(low, high, IS_BF16)
    if TILE_SCALES:
        element_encode, byte, _ = _tile_scales(block_amax, enc, dec, ROWS, NB)
    else:
        element_encode, byte, _ = _block_scales(block_amax, enc, dec, ROWS, NB, BLOCK_2D)
    FAST: tl.constexpr = low.dtype == tl.int32 and not INTERPRET and ROWS <= FAST_MAX_ROWS
    code_words = tl.join(_pack_codes(low_even, low_odd, element_encode, ROWS, NB, FAST),
                         _pack_codes(high_even, high_odd, element_encode, ROWS, NB, FAST))
    _store_quantized(code_words_ptr, scales_ptr, code_words, byte, rows, row_mask, blocks, KB, FAST)


# ----------------------------------------------------------------------------------------- kernels
#
# Integer arguments that vary from call to call are not specialized (each value of 1, or multiple of
# 16, would otherwise compile a new variant); alignment comes from ``KB * 8`` instead.

_NO_SPECIALIZE = ["mat_rows", "amax_div", "R", "KB", "m_bucket"]


@triton.jit(do_not_specialize=["n_blocks", "n_iter"])
def _amax_kernel(x_ptr, out_ptr, n_blocks, n_iter, BLOCK: tl.constexpr):
    """``max|x|`` over ``16 * n_blocks`` elements into ``out_ptr`` (int32 bits of a zeroed fp32;
    amax >= 0). The size as a multiple of 16 keeps the masked loads vectorized."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(n_iter):
        offs = (pid + i * nprog).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n_blocks * 16, other=0, eviction_policy="evict_last")
        acc = tl.maximum(acc, tl.abs(_to_f32(x)))
    # non-negative floats order like their int32 bit patterns
    tl.atomic_max(out_ptr, tl.max(acc, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _leading_amax_part(x_ptr, out_ptr, slice_index, part, parts, n_blocks, n_iter, BLOCK: tl.constexpr):
    """Part ``part`` of ``parts`` of slice ``slice_index`` (``16 * n_blocks`` elements): its chunks of
    ``BLOCK`` elements ``part, part + parts, ...`` folded into ``out_ptr[slice_index]`` (int32 bits of
    a zeroed fp32). NaN wins: its bits order above every other non-negative float's."""
    base = slice_index.to(tl.int64) * n_blocks * 16
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(n_iter):
        offs = (part + i * parts).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + offs, mask=offs < n_blocks * 16, other=0, eviction_policy="evict_first")
        # |x| as int32 bits: they order like the floats, with NaN above inf (a float max may drop NaN)
        acc = tl.maximum(acc, _to_f32(x).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    tl.atomic_max(out_ptr + slice_index, tl.max(acc, axis=0))


@triton.jit(do_not_specialize=["n_blocks", "n_iter"])
def _leading_amax_kernel(x_ptr, out_ptr, n_blocks, n_iter, BLOCK: tl.constexpr):
    """Grid ``(P, n)``: ``max|x[i]|`` of each of the ``n`` leading slices (``16 * n_blocks`` elements
    each) into ``out_ptr[i]``, ``P`` programs a slice (:func:`_leading_amax_part`)."""
    _leading_amax_part(x_ptr, out_ptr, tl.program_id(1), tl.program_id(0), tl.num_programs(0), n_blocks, n_iter, BLOCK)


@triton.jit
def _quantize_row_tiles(w_ptr, amax_ptr, codes_ptr, scales_ptr, R, mat_rows, amax_div, KB, row_tile, k_tile, step,
                        BLOCK_2D: tl.constexpr, IS_BF16: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr,
                        PERSISTENT: tl.constexpr, FAST_MAX_ROWS: tl.constexpr, TILE_SCALES: tl.constexpr):
    """Quantize the ``[ROWS, NB * 16]`` tiles of K tile ``k_tile`` in row tiles ``row_tile, row_tile +
    step, ...`` of the ``R`` rows (``PERSISTENT``, loading the next tile's words into registers before
    the current one is quantized, so a program always has reads in flight; otherwise row tile
    ``row_tile`` alone)."""
    blocks = k_tile * NB + tl.arange(0, NB)
    n_row_tiles = (R // mat_rows) * tl.cdiv(mat_rows, ROWS)  # mat_rows == R without BLOCK_2D
    enc_s, dec_s, decode_s = global_scales(tl.load(amax_ptr))  # used when one amax covers every row
    rows, row_mask = _tile_rows(row_tile, mat_rows, ROWS, BLOCK_2D)
    if amax_div == 0:
        enc, dec, _unused = _broadcast_rows(enc_s, dec_s, decode_s, ROWS)
    else:
        enc, dec, _unused = _table_scales(amax_ptr, rows, row_mask, amax_div)
    if not PERSISTENT:  # the grid covers every tile
        low, high = _load_halves(w_ptr, rows, row_mask, blocks, KB, "evict_first")
        _quantize_tile(codes_ptr, scales_ptr, low, high, enc, dec, rows, row_mask, blocks, KB, ROWS, NB, BLOCK_2D, IS_BF16,
                       FAST_MAX_ROWS, TILE_SCALES)
    else:
        low, high = _load_halves(w_ptr, rows, row_mask & (row_tile < n_row_tiles), blocks, KB, "evict_first")
        while row_tile < n_row_tiles:
            next_rows, next_mask = _tile_rows(row_tile + step, mat_rows, ROWS, BLOCK_2D)
            next_low, next_high = _load_halves(w_ptr, next_rows, next_mask & (row_tile + step < n_row_tiles), blocks, KB,
                                               "evict_first")
            if amax_div != 0:
                enc, dec, _unused = _table_scales(amax_ptr, rows, row_mask, amax_div)
            _quantize_tile(codes_ptr, scales_ptr, low, high, enc, dec, rows, row_mask, blocks, KB, ROWS, NB, BLOCK_2D,
                           IS_BF16, FAST_MAX_ROWS, TILE_SCALES)
            row_tile += step
            low, high, rows, row_mask = next_low, next_high, next_rows, next_mask


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _quantize_kernel(w_ptr, amax_ptr, codes_ptr, scales_ptr, R, mat_rows, amax_div, KB, m_bucket,
                     BLOCK_2D: tl.constexpr, IS_BF16: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr,
                     PERSISTENT: tl.constexpr, FAST_MAX_ROWS: tl.constexpr, TILE_SCALES: tl.constexpr):
    """Grid ``(P, cdiv(KB, NB))``: program ``(p, k)`` quantizes K tile ``k`` of row tiles ``p, p + P,
    ...`` (:func:`_quantize_row_tiles`; without ``PERSISTENT`` ``P`` covers every row tile).
    ``m_bucket`` is only an autotune key."""
    _quantize_row_tiles(w_ptr, amax_ptr, codes_ptr, scales_ptr, R, mat_rows, amax_div, KB, tl.program_id(0),
                        tl.program_id(1), tl.num_programs(0), BLOCK_2D, IS_BF16, ROWS, NB, PERSISTENT, FAST_MAX_ROWS,
                        TILE_SCALES)


@triton.jit(do_not_specialize=["R", "amax_div", "KB", "q_row_programs", "q_programs", "a_blocks", "a_iter", "a_parts",
                               "a_programs"])
def _quantize_and_amax_kernel(w_ptr, amax_ptr, codes_ptr, scales_ptr, R, amax_div, KB, q_row_programs, q_programs,
                              a_ptr, a_out_ptr, a_blocks, a_iter, a_parts, a_programs,
                              IS_BF16: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr,
                              FAST_MAX_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Two independent jobs in one launch: ``q_programs`` programs quantize ``w`` with 1x16 blocks and
    one amax per ``amax_div`` rows (as :func:`_quantize_kernel`'s persistent grid ``(q_row_programs,
    k tiles)``), and ``a_programs`` programs fold the per-slice amax of another tensor ``a`` (as
    :func:`_leading_amax_kernel`, ``a_parts`` programs a slice). The quantization is busy computing
    while the amax only streams memory, so together they keep both the SMs and DRAM busy. The two
    kinds alternate in program order, so the first waves on the SMs hold both."""
    pid = tl.program_id(0)
    mixed = 2 * tl.minimum(q_programs, a_programs)
    if pid < mixed:
        is_amax = pid % 2 == 1
        index = pid // 2
    else:
        is_amax = a_programs > q_programs
        index = pid - mixed // 2
    if is_amax:
        _leading_amax_part(a_ptr, a_out_ptr, index // a_parts, index % a_parts, a_parts, a_blocks, a_iter, BLOCK)
    else:
        _quantize_row_tiles(w_ptr, amax_ptr, codes_ptr, scales_ptr, R, R, amax_div, KB, index % q_row_programs,
                            index // q_row_programs, q_row_programs, False, IS_BF16, ROWS, NB, True, FAST_MAX_ROWS, False)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _fake_quant_kernel(w_ptr, amax_ptr, y_ptr, R, amax_div, KB, m_bucket,
                       IS_BF16: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr, STAGES: tl.constexpr):
    """``((e2m1 * scale) * (amax / 2688))`` in the input dtype, written as words like the input's;
    persistent over row tiles like :func:`_quantize_kernel`."""
    blocks = tl.program_id(1) * NB + tl.arange(0, NB)
    enc_s, dec_s, decode_s = global_scales(tl.load(amax_ptr))  # used when one amax covers every row
    for row_tile in tl.range(tl.program_id(0), tl.cdiv(R, ROWS), tl.num_programs(0), num_stages=STAGES):
        rows, row_mask = _tile_rows(row_tile, R, ROWS, False)
        words, offsets, mask = _load_words(w_ptr, rows, row_mask, blocks, KB, "evict_first")
        even, odd = _words_to_f32(words, IS_BF16)
        if amax_div == 0:
            enc, dec, decode = _broadcast_rows(enc_s, dec_s, decode_s, ROWS)
        else:
            enc, dec, decode = _table_scales(amax_ptr, rows, row_mask, amax_div)
        scaled_even, scaled_odd, _, scale = _scale_pairs(even, odd, enc, dec, ROWS, NB, False)
        # the reference multiplies the signed E2M1 value (-0.0 for code 8) by the scale: taking the sign
        # from the scale instead gives the same product, bit for bit
        scale = scale[:, :, None]
        neg_scale = scale * -1.0  # Triton's unary minus is 0 - x, which gives +0 for x = 0
        decode = decode[:, None, None]
        y_even = (e2m1_magnitude(scaled_even) * tl.where(scaled_even < 0.0, neg_scale, scale)) * decode
        y_odd = (e2m1_magnitude(scaled_odd) * tl.where(scaled_odd < 0.0, neg_scale, scale)) * decode
        tl.store(y_ptr + offsets, _f32_to_words(y_even, y_odd, words.dtype, IS_BF16), mask=mask)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _row_amax_quantize_kernel(w_ptr, codes_ptr, scales_ptr, amax_ptr, decode_ptr, R, KB, m_bucket,
                              IS_BF16: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr):
    """Whole rows per program: a pass over K for the row amax, a second one to quantize."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < R
    amax = tl.zeros([ROWS], tl.float32)
    for b0 in range(0, KB, NB):
        low, high = _load_halves(w_ptr, rows, row_mask, b0 + tl.arange(0, NB), KB, "evict_last")
        block_amax = _halves_to_f32(low, high, IS_BF16)[4]
        amax = tl.maximum(amax, tl.max(block_amax, axis=1))
    enc, dec, decode = global_scales(amax)
    for b0 in range(0, KB, NB):
        blocks = b0 + tl.arange(0, NB)
        low, high = _load_halves(w_ptr, rows, row_mask, blocks, KB, "evict_first")
        _quantize_tile(codes_ptr, scales_ptr, low, high, enc, dec, rows, row_mask, blocks, KB, ROWS, NB, False, IS_BF16,
                       ROWS)
    tl.store(amax_ptr + rows, amax, mask=row_mask)
    tl.store(decode_ptr + rows, decode, mask=row_mask)


# ----------------------------------------------------------------------------------------- launch configs
#
# A config is ``(ROWS, NB, num_warps)``: tiles of ROWS rows by NB blocks of 16 (the row kernel loops
# over K in steps of NB blocks). The compiler gives each thread whole blocks where it can (two 16-byte
# loads of a 16-bit row segment); a tile should hold at least one block per thread. By default a
# shape heuristic picks the config; with MEGATRON_QUADS_AUTOTUNE=1 ``triton.autotune`` times the
# candidates once per (row-count bucket, K, ...) key: slow first calls, for benchmarking.

ENV_AUTOTUNE = "MEGATRON_QUADS_AUTOTUNE"
_TILE_CONFIGS = [(1, 128, 4), (8, 16, 4), (16, 16, 4), (32, 16, 4), (16, 32, 4), (64, 16, 8)]
_ROW_CONFIGS = [(1, 128, 4), (1, 256, 8), (2, 128, 8), (4, 32, 4), (4, 64, 8)]


def _tile_config(rows: int, block_2d: bool, blocks: int) -> tuple[int, int, int]:
    """Default tile for the quantize / fake-quant kernels (``blocks``: 16-element blocks per row).

    A row segment of 128 blocks per program (1 x 128, 4 warps: one block a thread); 2D scaling
    needs whole 16-row tiles: 16 x 32 blocks on 4 warps (four blocks a thread), one program per tile.
    Short rows keep several rows per program so that a tile still holds one block per thread. The
    fastest of the tile sweep (``benchmarks/bench_kernels.py --only quantize_tiles``, docs/kernels.md).
    """
    if block_2d:
        return 16, 32, 4
    if blocks >= 128:
        return 1, 128, 4
    if blocks >= 64 and rows >= 2:
        return 2, 64, 4
    if rows >= 16:
        return 16, 16, 4
    if rows >= 8:
        return 8, 16, 4
    return 1, 128, 4


_ONE_PER_TILE = 1 << 20
_LOOP_CONFIG = 32
"""Programs per SM of the persistent quantize kernel with 1x16 blocks (each loads its next tile
while it quantizes the current one): faster than one program per tile in the
``quantize_tiles`` sweep."""
_LOOP_CONFIG_2D = _ONE_PER_TILE
"""16x16 blocks: one program per tile, no loop (the persistent loop measured slower there)."""
_FAKE_QUANT_LOOP = (16, 3)
"""``(programs per SM, STAGES)`` of the persistent fake-quant kernel (``STAGES - 1`` tiles of async
copies in flight)."""


_FAST_MAX_ROWS = 16
"""Tiles of up to this many rows (1x16 and 16x16 alike) take the PTX codes and direct stores of
:func:`_quantize_tile`; larger ones Triton's arithmetic and stores (the direct path is the faster
one on every 16-row tile of the ``quantize_tiles`` sweep)."""


def _fast_max_rows() -> int:
    """:data:`_FAST_MAX_ROWS`, read at each launch (tests set it to run every tile config both ways)."""
    return _FAST_MAX_ROWS


def _loop_config(block_2d: bool = False) -> int:
    """Programs per SM of the quantize kernel (:data:`_ONE_PER_TILE`: no loop), read at each launch
    (tests set it to make programs walk many tiles)."""
    return _LOOP_CONFIG_2D if block_2d else _LOOP_CONFIG


def _persistent_grid(device: torch.device, row_tiles: int, k_tiles: int, per_sm: int) -> tuple[int, int]:
    """``(P, k_tiles)`` programs: one per tile up to ``per_sm * SMs`` in all; beyond that, each
    program loops over row tiles."""
    per_k = max(1, per_sm * _num_sms(device) // k_tiles)
    return (max(1, min(row_tiles, per_k)), k_tiles)


def _row_config(rows: int) -> tuple[int, int, int]:
    """Default for the row-amax kernel (one program per ROWS rows): enough programs to fill the GPU."""
    return (4, 32, 4) if rows >= 2048 else (1, 128, 4)


def _autotune_enabled() -> bool:
    return os.environ.get(ENV_AUTOTUNE, "0") == "1" and not _INTERPRET


def _prune_for_2d(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """16x16 tiles need whole tiles per program: keep configs with ROWS % 16 == 0."""
    if not kwargs.get("BLOCK_2D", False):
        return configs
    return [c for c in configs if c.kwargs["ROWS"] % 16 == 0]


def _quick_bench(kernel_call: object, quantiles: tuple[float, ...]) -> list[float]:
    return triton.testing.do_bench(kernel_call, warmup=10, rep=40, quantiles=quantiles)


def _autotuned(kernel: triton.runtime.JITFunction, configs: list[tuple[int, int, int]], key: list[str],
               **kwargs: object) -> triton.runtime.Autotuner:
    """``kernel`` autotuned over ``configs``; the kernels are idempotent, so timing them on the real
    outputs is harmless."""
    tuning = [triton.Config({"ROWS": r, "NB": nb}, num_warps=w) for r, nb, w in configs]
    return triton.autotune(configs=tuning, key=["m_bucket", *key], do_bench=_quick_bench, **kwargs)(kernel)


_QUANTIZE_TUNED = _autotuned(_quantize_kernel, _TILE_CONFIGS, ["KB", "BLOCK_2D", "IS_BF16"],
                             prune_configs_by={"early_config_prune": _prune_for_2d})
_FAKE_QUANT_TUNED = _autotuned(_fake_quant_kernel, _TILE_CONFIGS, ["KB", "IS_BF16"])
_ROW_AMAX_TUNED = _autotuned(_row_amax_quantize_kernel, _ROW_CONFIGS, ["KB", "IS_BF16"])


def _launch(kernel: triton.runtime.JITFunction, tuned: triton.runtime.Autotuner, config: tuple[int, int, int],
            grid: object, args: tuple, **constexprs: object) -> None:
    """Run ``kernel`` with ``config``, or its autotuned twin when autotuning is on.

    ``grid(rows_per_tile, blocks_per_tile)`` gives the launch grid; ``args`` ends with the row count
    (mapped to its ``m_bucket`` autotune key).
    """
    *args, rows = args
    args = (*args, min(triton.next_power_of_2(max(rows, 1)), _M_BUCKET_CAP))
    if _autotune_enabled():
        tuned[lambda meta: grid(meta["ROWS"], meta["NB"])](*args, **constexprs)
    else:
        rows_per_tile, blocks_per_tile, num_warps = config
        kernel[grid(rows_per_tile, blocks_per_tile)](
            *args, **constexprs, ROWS=rows_per_tile, NB=blocks_per_tile, num_warps=num_warps
        )


# ----------------------------------------------------------------------------------------- host side


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _bits_view(x: torch.Tensor) -> torch.Tensor:
    """What :func:`_amax_kernel` loads: bf16 as its int16 bits (see :func:`_to_f32`), others as they are."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _words_view(x: torch.Tensor) -> torch.Tensor:
    """Contiguous ``x`` as words of two elements ``[..., K/2]``: int64 for fp32, int32 for 16-bit dtypes."""
    if x.storage_offset() % 2:
        x = x.clone()  # a word must not straddle two elements of different pairs
    return x.view(torch.int64 if x.dtype == torch.float32 else torch.int32)


def _check_out(t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], device: torch.device, name: str) -> None:
    if tuple(t.shape) != shape or t.dtype not in dtypes or t.device != device or not t.is_contiguous():
        raise ValueError(
            f"out {name} must be a contiguous {dtypes[0]} tensor of shape {shape} on {device}, got "
            f"{t.dtype} {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"
        )


def _code_buffers(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed-code and scale-byte (uint8) buffers for ``x``: ``out`` checked, or new ones."""
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    if out is None:
        return (torch.empty(lead + (k // 2,), dtype=torch.uint8, device=x.device),
                torch.empty(lead + (k // BLOCK_SIZE,), dtype=torch.uint8, device=x.device))
    codes, scales = out
    _check_out(codes, lead + (k // 2,), (torch.uint8,), x.device, "codes")
    _check_out(scales, lead + (k // BLOCK_SIZE,), (torch.float8_e4m3fn, torch.uint8), x.device, "scales")
    return codes, scales.view(torch.uint8)


def _code_words(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the kernels write the packed codes into: ``codes`` viewed as int32 (two words per block),
    or, when ``codes`` is not 8-byte aligned (a view into a larger buffer), a fresh buffer that is
    copied into ``codes`` afterwards (returned second)."""
    if codes.data_ptr() % 8 == 0:
        return codes.view(torch.int32), None
    return torch.empty_like(codes).view(torch.int32), codes


def _amax_rows(amax: torch.Tensor, lead: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """The amax of each row of ``x.reshape(-1, K)`` as ``(table, div)``: row ``r`` uses
    ``table[r // div]``, and ``div = 0`` means one amax for all rows (the kernels' ``amax_div``).

    Trailing leading dims over which ``amax`` is broadcast fold into ``div`` (a scalar, or ``[E, 1]``
    for ``[E, N, K]``, needs no copy); other broadcasts are materialized.
    """
    if torch.broadcast_shapes(amax.shape, lead) != torch.Size(lead):
        raise ValueError(f"global_amax of shape {tuple(amax.shape)} must broadcast to the leading dims {lead}")
    expanded = torch.broadcast_to(amax.to(torch.float32), lead)
    kept, div = len(lead), 1
    while kept and (expanded.stride(kept - 1) == 0 or lead[kept - 1] == 1):
        kept -= 1
        div *= lead[kept]
    table = expanded[(...,) + (0,) * (len(lead) - kept)].contiguous().reshape(-1)
    return table, 0 if table.numel() == 1 else div


def _check_shape(x: torch.Tensor, block_2d: bool) -> None:
    """The checks of :func:`validate_input` that need no look at the values (so no host sync)."""
    if x.dtype not in SUPPORTED_DTYPES or x.ndim == 0 or x.shape[-1] % BLOCK_SIZE or (block_2d and x.ndim < 2):
        raise ValueError(
            f"NVFP4 quantize needs a bf16/fp16/fp32 tensor whose last dim is a multiple of {BLOCK_SIZE} "
            f"(and 2 dims for 2D blocks), got {x.dtype} of shape {tuple(x.shape)}"
        )


def _num_rows(x: torch.Tensor) -> int:
    """Rows of ``x.reshape(-1, K)``; the kernels index rows with int32."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows >= 2**31:
        raise ValueError(f"NVFP4 kernels support fewer than 2^31 rows, got {rows} for shape {tuple(x.shape)}")
    return rows


def amax_kernel(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor ``max(|x|)`` as a 0-dim fp32 tensor on ``x``'s device, without a host sync."""
    x = x.contiguous()
    bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    n = x.numel()
    if n:
        if n % BLOCK_SIZE:
            raise ValueError(f"amax_kernel needs a multiple of {BLOCK_SIZE} elements, got {tuple(x.shape)}")
        n_chunks = triton.cdiv(n, _AMAX_BLOCK)
        grid = min(n_chunks, 4 * _num_sms(x.device))
        _amax_kernel[(grid,)](_bits_view(x), bits, n // BLOCK_SIZE, triton.cdiv(n_chunks, grid),
                              BLOCK=_AMAX_BLOCK, num_warps=8)
    return bits.view(torch.float32).reshape(())


def leading_amax_kernel(x: torch.Tensor) -> torch.Tensor:
    """``max(|x[i]|)`` of each slice along the first dimension, fp32 ``[x.shape[0]]``, no host sync."""
    x = x.contiguous()
    n = x.shape[0] if x.ndim else 1
    bits = torch.zeros(n, dtype=torch.int32, device=x.device)
    per = x.numel() // n if n else 0
    if per:
        if per % BLOCK_SIZE:
            raise ValueError(f"leading_amax_kernel needs slices of a multiple of {BLOCK_SIZE} elements, got {tuple(x.shape)}")
        n_chunks = triton.cdiv(per, _AMAX_BLOCK)
        programs = max(1, min(n_chunks, triton.cdiv(4 * _num_sms(x.device), n)))
        _leading_amax_kernel[(programs, n)](_bits_view(x), bits, per // BLOCK_SIZE, triton.cdiv(n_chunks, programs),
                                            BLOCK=_AMAX_BLOCK, num_warps=8)
    return bits.view(torch.float32)


_PAIRED_QUANTIZE_PER_SM = 32
"""Quantizing programs per SM of :func:`quantize_stack_and_amax`."""
_PAIRED_AMAX_PER_SM = 2
"""Amax programs per SM of :func:`quantize_stack_and_amax`."""


def quantize_stack_and_amax(x: torch.Tensor, amax: torch.Tensor, other: torch.Tensor) -> tuple[NVFP4Tensor, torch.Tensor]:
    """``(quantize_kernel(x, amax[:, None], validate=False), leading_amax_kernel(other))`` in one launch:
    ``x`` is a ``[n, N, K]`` stack quantized with one amax per expert (fp32 ``[n]`` on ``x``'s device),
    ``other`` any tensor whose per-slice amax is wanted (the next stack). The same bytes as the two
    calls; no host sync and no NaN / Inf check."""
    _check_shape(x, False)
    if x.ndim != 3 or amax.shape != (x.shape[0],) or amax.dtype != torch.float32 or amax.device != x.device:
        raise ValueError(f"quantize_stack_and_amax needs a [n, N, K] stack and an fp32 amax [n] on its device, got "
                         f"{tuple(x.shape)} and {amax.dtype} {tuple(amax.shape)} on {amax.device}")
    x, other = x.contiguous(), other.contiguous()
    m = other.shape[0] if other.ndim else 1
    per = other.numel() // m if m else 0
    if other.device != x.device or per % BLOCK_SIZE or not x.numel() or not per:
        return quantize_kernel(x, amax[:, None], validate=False), leading_amax_kernel(other)
    n, mat_rows, k = x.shape
    rows, kb = _num_rows(x), k // BLOCK_SIZE
    row_tile, nb, warps = _tile_config(rows, False, kb)
    k_tiles = triton.cdiv(kb, nb)
    q_rows = _persistent_grid(x.device, triton.cdiv(rows, row_tile), k_tiles, _PAIRED_QUANTIZE_PER_SM)[0]
    a_chunks = triton.cdiv(per, _AMAX_BLOCK)
    a_parts = max(1, min(a_chunks, triton.cdiv(_PAIRED_AMAX_PER_SM * _num_sms(x.device), m)))
    codes, scales = _code_buffers(x, None)
    words, misaligned = _code_words(codes)
    bits = torch.zeros(m, dtype=torch.int32, device=x.device)
    amax = amax.contiguous()
    q_programs, a_programs = q_rows * k_tiles, m * a_parts
    _quantize_and_amax_kernel[(q_programs + a_programs,)](
        _words_view(x), amax, words, scales, rows, mat_rows, kb, q_rows, q_programs,
        _bits_view(other), bits, per // BLOCK_SIZE, triton.cdiv(a_chunks, a_parts), a_parts, a_programs,
        IS_BF16=x.dtype == torch.bfloat16, ROWS=row_tile, NB=nb, FAST_MAX_ROWS=_fast_max_rows(), BLOCK=_AMAX_BLOCK,
        num_warps=warps)
    if misaligned is not None:
        misaligned.copy_(words.view(torch.uint8))
    quantized = NVFP4Tensor(codes=codes, scales=scales.view(torch.float8_e4m3fn),
                            weight_scale_2=decode_scale_from_amax(amax[:, None]), shape=x.shape, dtype=x.dtype,
                            global_amax=amax[:, None], block_2d=False)
    return quantized, bits.view(torch.float32)


def _launch_quantize(x: torch.Tensor, amax_rows: tuple[torch.Tensor, int], codes: torch.Tensor,
                     scales: torch.Tensor, block_2d: bool) -> None:
    """Run :func:`_quantize_kernel` on contiguous ``x`` (rows of length K; 16-row tiles per matrix if 2D)."""
    kb = x.shape[-1] // BLOCK_SIZE
    rows = _num_rows(x)
    mat_rows = x.shape[-2] if block_2d else rows
    n_mats = rows // mat_rows

    def grid(rows_per_tile: int, blocks_per_tile: int) -> tuple[int]:
        return _persistent_grid(x.device, n_mats * triton.cdiv(mat_rows, rows_per_tile), triton.cdiv(kb, blocks_per_tile),
                                _loop_config(block_2d))

    table, div = amax_rows
    words, misaligned = _code_words(codes)
    _launch(_quantize_kernel, _QUANTIZE_TUNED, _tile_config(rows, block_2d, kb), grid,
            (_words_view(x), table, words, scales, rows, mat_rows, div, kb, rows),
            BLOCK_2D=block_2d, IS_BF16=x.dtype == torch.bfloat16, PERSISTENT=_loop_config(block_2d) < _ONE_PER_TILE,
            FAST_MAX_ROWS=_fast_max_rows(),
            TILE_SCALES=block_2d and (div == 0 or (mat_rows > 0 and div % mat_rows == 0)))
    if misaligned is not None:
        misaligned.copy_(words.view(torch.uint8))


# ----------------------------------------------------------------------------------------- public API


def quantize_kernel(
    x: torch.Tensor,
    global_amax: AmaxLike = None,
    block_2d: bool = False,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    validate: bool = True,
) -> NVFP4Tensor:
    """Triton twin of :func:`megatron_quads.nvfp4.quantize.quantize`: the same fields, byte for byte.

    ``global_amax`` is ``None`` (per-tensor amax, reduced on the device), a scalar, or one amax per
    leading index (broadcastable to ``x.shape[:-1]``). ``out`` optionally gives the ``(codes uint8
    [..., K/2], scales uint8 or float8_e4m3fn [..., K/16])`` buffers to write. Validation is the
    reference's: it reads all of ``x`` for NaN / Inf and waits for the result on the host.
    ``validate=False`` keeps only the shape and dtype checks (no sync; garbage in, garbage out).
    """
    if validate:
        validate_input(x, BLOCK_SIZE, block_2d)
    else:
        _check_shape(x, block_2d)
    x = x.contiguous()
    lead = tuple(x.shape[:-1])
    if global_amax is None:
        amax = amax_kernel(x)
        amax_rows = (amax.reshape(1), 0)
    else:
        if validate:
            amax = global_amax_tensor(global_amax, x)
        else:
            amax = torch.as_tensor(global_amax, dtype=torch.float32, device=x.device)
        amax_rows = _amax_rows(amax, lead)
    codes, scales = _code_buffers(x, out)
    if x.numel():
        _launch_quantize(x, amax_rows, codes, scales, block_2d)
    return NVFP4Tensor(
        codes=codes,
        scales=scales.view(torch.float8_e4m3fn),
        weight_scale_2=decode_scale_from_amax(amax),
        shape=x.shape,
        dtype=x.dtype,
        global_amax=amax,
        block_2d=block_2d,
    )


def fake_quant_kernel(
    x: torch.Tensor, global_amax: torch.Tensor | float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton twin of :func:`megatron_quads.nvfp4.fused.fake_quant_values` (1x16 blocks), bit for bit.

    One launch, no validation and no host sync: pass finite values whose last dim is a multiple of 16
    and an fp32 amax on ``x``'s device, a scalar or broadcastable to ``x.shape[:-1]`` (a Python float
    is copied to the device first). ``out`` (contiguous, ``x``'s shape and dtype) receives the result
    if given. No autograd: the result has no gradient function.
    """
    x = x.contiguous()
    amax = torch.as_tensor(global_amax, dtype=torch.float32, device=x.device)
    table, div = _amax_rows(amax, tuple(x.shape[:-1]))
    if out is None:
        out = torch.empty_like(x)
    else:
        _check_out(out, tuple(x.shape), (x.dtype,), x.device, "values")
    kb = x.shape[-1] // BLOCK_SIZE
    rows = _num_rows(x)
    if rows and kb:
        target = out if out.storage_offset() % 2 == 0 else torch.empty_like(x)

        def grid(rows_per_tile: int, blocks_per_tile: int) -> tuple[int]:
            return _persistent_grid(x.device, triton.cdiv(rows, rows_per_tile), triton.cdiv(kb, blocks_per_tile),
                                    _FAKE_QUANT_LOOP[0])

        _launch(_fake_quant_kernel, _FAKE_QUANT_TUNED, _tile_config(rows, False, kb), grid,
                (_words_view(x), table, _words_view(target), rows, div, kb, rows),
                IS_BF16=x.dtype == torch.bfloat16, STAGES=_FAKE_QUANT_LOOP[1])
        if target is not out:
            out.copy_(target)
    return out


def row_amax_quantize_kernel(
    x2d: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> NVFP4Tensor:
    """Per-row (per-token) dynamic NVFP4: ``quantize(x, global_amax=x.abs().amax(-1).float())``.

    One kernel computes each row's amax and quantizes the row with it; ``global_amax`` and
    ``weight_scale_2`` of the result are fp32 ``x.shape[:-1]``. No host sync, and no NaN / Inf check.
    ``out`` optionally gives ``(codes, scales, global_amax, weight_scale_2)`` buffers.
    """
    if x2d.dtype not in SUPPORTED_DTYPES or x2d.ndim == 0 or x2d.shape[-1] == 0 or x2d.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"row_amax_quantize_kernel needs a bf16/fp16/fp32 tensor whose last dim is a non-zero multiple "
            f"of {BLOCK_SIZE}, got {x2d.dtype} of shape {tuple(x2d.shape)}"
        )
    x = x2d.contiguous()
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    codes, scales = _code_buffers(x, None if out is None else out[:2])
    if out is None:
        amax = torch.empty(lead, dtype=torch.float32, device=x.device)
        decode = torch.empty(lead, dtype=torch.float32, device=x.device)
    else:
        amax, decode = out[2], out[3]
        _check_out(amax, lead, (torch.float32,), x.device, "global_amax")
        _check_out(decode, lead, (torch.float32,), x.device, "weight_scale_2")
    rows = _num_rows(x)
    if rows:

        def grid(rows_per_tile: int, blocks_per_tile: int) -> tuple[int]:
            return (triton.cdiv(rows, rows_per_tile),)

        words, misaligned = _code_words(codes)
        _launch(_row_amax_quantize_kernel, _ROW_AMAX_TUNED, _row_config(rows), grid,
                (_words_view(x), words, scales, amax, decode, rows, k // BLOCK_SIZE, rows),
                IS_BF16=x.dtype == torch.bfloat16)
        if misaligned is not None:
            misaligned.copy_(words.view(torch.uint8))
    return NVFP4Tensor(
        codes=codes,
        scales=scales.view(torch.float8_e4m3fn),
        weight_scale_2=decode,
        shape=x.shape,
        dtype=x.dtype,
        global_amax=amax,
        block_2d=False,
    )
