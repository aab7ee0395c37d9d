"""Triton W4A16 NVFP4 linears (dense and grouped MoE): bf16 activations times NVFP4 weights.

The weight operand ``e2m1(code) * e4m3(block scale)`` is exact in bf16 (at most 6 significant bits,
magnitudes in ``[2^-10, 2688]``), so the kernels dequantize it in registers (two weights per 32-bit
operation, :data:`_DEQUANT_WORD_PTX`), run ``tl.dot`` with fp32 accumulation and multiply the
accumulator by the per-tensor (or per-expert) ``weight_scale_2`` in the epilogue. Results equal the PyTorch references
(:func:`megatron_quads.rollout.w4a4.w4a16_linear`, :func:`megatron_quads.rollout.grouped.grouped_w4a16_linear`)
up to fp32 summation order.

Layout (decode-shaped, weight-byte bound): swap-AB, so a program computes a ``y^T`` tile
``W[BLOCK_N, K] @ x[BLOCK_M, K]^T`` with the large N on the MMA's M side and the few tokens on its
N side. Codes are loaded as int32 words and the K order inside a tile is permuted (x with it, in
registers) so that each MMA operand register comes from one word (:func:`dequant_mma_tile`). The
dense kernel splits K over ``SPLIT_K`` programs per output tile; each writes an fp32
partial tile and bumps a per-tile arrival counter, and the last one to arrive sums the partials in
split order (deterministic), applies the epilogue and resets the counter to 0 for the next launch
(one launch, no memset). The grouped kernel runs one program per (N tile, expert) that walks the
expert's rows in chunks of ``BLOCK_M`` (half as wide for an expert of at most ``BLOCK_M / 2`` rows);
experts without rows exit after two loads.

:func:`w4a16_linear_into` and :func:`grouped_w4a16_into` run these kernels or, on sm_90, the
warp-specialized Gluon ones, by the rule of :mod:`~megatron_quads.kernels.dispatch`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

from megatron_quads.kernels.dispatch import (
    X_ORDER_BLOCK_K,
    gluon_module,
    resolve_dense_w4a16,
    resolve_grouped_w4a16,
)
from megatron_quads.nvfp4.tensor import NVFP4Tensor
from megatron_quads.nvfp4.triton_codec import INTERPRET, e2m1_to_f32, e4m3_to_f32, round_f32_to

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_KERNEL_DTYPES = (torch.bfloat16,)
"""bf16 only: the dequantization builds bf16x2 operands; fp16 activations take the reference path."""
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Output dtypes of the W4A4 + RAC path through these kernels (the epilogue rounds fp32 to any of them)."""
_SPLIT_WINDOW = (0.9, 6.0)
"""Split-K aims for between 0.9x and 6x as many programs as the GPU has SMs."""
_MAX_SPLIT_M = 64
"""Split-K is only used up to this many tokens (one token tile: decode); beyond, the partials get
large and the token tiles give the parallelism, so larger inputs use the autotuner without it."""


# --------------------------------------------------------------------------------------------------
# Device functions
# --------------------------------------------------------------------------------------------------


OPERAND_LOG2_SCALE = tl.constexpr(-8)
"""``log2`` of the factor :func:`dequant_mma_tile` leaves on its operand (the epilogue undoes it)."""

# Per word of 8 codes and a bf16x2 pair (s, s) with s = block scale * 2^118: four bf16x2 results.
# Pair q holds nibbles q (low half) and q + 4 (high half), 16 bits apart in the word. One and
# isolates the two nibbles, one integer multiply by 2^a + 2^(a+6) makes two shifted copies that do
# not overlap (so no carries): the first puts e1 e0 m on bf16 bits 8..6, the second the sign on bit
# 15 (and 31 for the high half), and one and keeps exactly those bits. That is the bf16 code * 2^-126
# (exponent field e, mantissa m; code 1 is a subnormal, which the bf16x2 multiply keeps). One
# mul.rn.bf16x2 by the scale pair gives code * scale * 2^-8 exactly (at most 6 significant bits,
# normal range), signed zeros included. 4 instructions per 2 weights, plus one shift per word.
_DEQUANT_WORD_PTX = tl.constexpr("""
{
.reg .b32 a, b, r;
and.b32 a, $8, 0x000F000F;
mul.lo.u32 a, a, 4160;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$0, $1}, r;
and.b32 a, $8, 0x00F000F0;
mul.lo.u32 a, a, 260;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$2, $3}, r;
shr.u32 b, $8, 8;
and.b32 a, b, 0x000F000F;
mul.lo.u32 a, a, 4160;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$4, $5}, r;
and.b32 a, b, 0x00F000F0;
mul.lo.u32 a, a, 260;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 r, a, $9;
mov.b32 {$6, $7}, r;
}
""")

# Four E4M3 scale bytes (one register) to four bf16x2 pairs (s, s), s = scale * 2^118. Two bytes at a
# time go to the low byte of each half; (magnitude << 4) | (sign << 8) is the bf16 scale * 2^-120
# (E4M3 subnormals land on bf16 subnormals, exactly), and two exact multiplies by 2^119 (bf16
# 0x7B00) give scale * 2^118 (at most 448 * 2^118 < 2^127). prmt then copies each half to both.
_SCALE_HALF_PTX = """
prmt.b32 v, $4, 0, {select};
shl.b32 t, v, 4;
and.b32 t, t, 0x07F007F0;
shl.b32 u, v, 8;
lop3.b32 t, u, 0x80008000, t, 0xEA;
mul.rn.bf16x2 t, t, c;
mul.rn.bf16x2 t, t, c;
prmt.b32 ${lo}, t, 0, 0x1010;
prmt.b32 ${hi}, t, 0, 0x3232;
"""
_SCALE_PAIRS_PTX = tl.constexpr(
    "{\n.reg .b32 v, t, u, c;\nmov.b32 c, 0x7B007B00;"
    + _SCALE_HALF_PTX.format(select="0x4140", lo=0, hi=1)  # bytes 0, 1
    + _SCALE_HALF_PTX.format(select="0x4342", lo=2, hi=3)  # bytes 2, 3
    + "}\n"
)


@triton.jit
def _scale_pairs(scale_bytes):
    """Block-scale bytes to int32 words holding the bf16 ``scale * 2^118`` in both halves (exact)."""
    if INTERPRET:
        half = e4m3_to_f32(scale_bytes, 118).to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        pair = ((half << 16) | half).to(tl.int32, bitcast=True)
    else:
        pair = tl.inline_asm_elementwise(
            _SCALE_PAIRS_PTX, "=r,=r,=r,=r,r", [scale_bytes], dtype=tl.int32, is_pure=True, pack=4
        )
    return pair


@triton.jit
def _code_value(words, pairs, NIBBLE: tl.constexpr):
    """Interpreter stand-in for one output of :data:`_DEQUANT_WORD_PTX` (same values, fp32 math:
    ``(code * 2^-126) * (scale * 2^118)``, both products exact)."""
    code = (words >> (4 * NIBBLE)) & 0xF
    scale = (pairs & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    return ((e2m1_to_f32(code) * (2.0 ** -126)) * scale).to(tl.bfloat16)


@triton.jit
def _dequant_words(words, pairs):
    """The 8 codes of every word times its block scale: ``(q, h) -> nibble q + 4h`` as 8 bf16 tensors."""
    if INTERPRET:
        out = (
            _code_value(words, pairs, 0), _code_value(words, pairs, 4),
            _code_value(words, pairs, 1), _code_value(words, pairs, 5),
            _code_value(words, pairs, 2), _code_value(words, pairs, 6),
            _code_value(words, pairs, 3), _code_value(words, pairs, 7),
        )
    else:
        out = tl.inline_asm_elementwise(
            _DEQUANT_WORD_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, pairs],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
        )
    return out


@triton.jit
def dequant_mma_tile(words, scale_bytes):
    """Packed codes as int32 words (``[BN, BK/8]``) and scale bytes (uint8 ``[BN, BK/16]``) to the
    operand ``e2m1 * e4m3 * 2^OPERAND_LOG2_SCALE`` (exact in bf16), ``[BN, BK]`` in MMA K order.

    MMA K order (x is put in it by :func:`mma_k_order_x`): an MMA A-operand thread ``t`` (lane % 4)
    holds the pairs ``8 q0 + 2t + (0, 1)`` of each 16-wide K slice. Here thread ``t`` takes the
    ``I = BK/32`` consecutive words ``I t .. I t + I - 1`` of a row (one vector load), and word ``i``'s
    pair ``q = 2 q1 + q0`` (nibbles ``q`` and ``q + 4``) becomes logical column
    ``32 i + 16 q1 + 8 q0 + 2 t + h``: every operand register comes from one word, no data moves
    between threads.
    """
    BN: tl.constexpr = words.shape[0]
    NW: tl.constexpr = words.shape[1]
    I: tl.constexpr = NW // 4
    tl.static_assert(I % 2 == 0, "dequant_mma_tile needs BLOCK_K to be a multiple of 64")
    pairs = _scale_pairs(tl.reshape(scale_bytes, (BN, 4, I // 2)))
    pairs = tl.reshape(tl.broadcast_to(tl.expand_dims(pairs, 3), (BN, 4, I // 2, 2)), (BN, 4, I))
    o = _dequant_words(tl.reshape(words, (BN, 4, I)), pairs)
    # dims after the joins: (BN, t, i, h, q0, q1)
    v = tl.join(
        tl.join(tl.join(o[0], o[1]), tl.join(o[2], o[3])),
        tl.join(tl.join(o[4], o[5]), tl.join(o[6], o[7])),
    )
    v = tl.permute(v, (0, 2, 5, 4, 1, 3))  # (BN, i, q1, q0, t, h)
    return tl.reshape(v, (BN, NW * 8))


@triton.jit
def mma_k_order_x(xt):
    """Rows of a naturally ordered ``x^T`` tile ``[BK, BM]`` into the K order of :func:`dequant_mma_tile`.

    x is loaded contiguously (16-byte async copies into shared memory) and reordered in registers:
    physical row ``8 (I t + i) + 4 h + 2 q1 + q0`` becomes logical row ``32 i + 16 q1 + 8 q0 + 2 t + h``.
    """
    BK: tl.constexpr = xt.shape[0]
    BM: tl.constexpr = xt.shape[1]
    I: tl.constexpr = BK // 32
    xt = tl.reshape(xt, (4, I, 2, 2, 2, BM))  # (t, i, h, q1, q0, m)
    xt = tl.permute(xt, (1, 3, 4, 0, 2, 5))  # (i, q1, q0, t, h, m)
    return tl.reshape(xt, (BK, BM))


_X_ORDER_BLOCK = tl.constexpr(X_ORDER_BLOCK_K)


def mma_k_order_rows(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """``x [T, K]`` with each ``block_k`` run of a row in :func:`mma_k_order_x`'s K order (a copy), for
    the grouped kernel's ``X_MMA_ORDER`` path: position ``32 i + 16 q1 + 8 q0 + 2 t + h`` of a run takes
    element ``8 (I t + i) + 4 h + 2 q1 + q0`` (``I = block_k / 32``)."""
    t_rows, k = x.shape
    if block_k % 64 or k % block_k:
        raise ValueError(f"block_k must be a multiple of 64 dividing K = {k}, got {block_k}")
    runs = x.reshape(t_rows, k // block_k, 4, block_k // 32, 2, 2, 2)  # (T, kt, t, i, h, q1, q0)
    return runs.permute(0, 1, 3, 5, 6, 2, 4).reshape(t_rows, k)  # (T, kt, i, q1, q0, t, h)


@triton.jit
def _accumulate(acc, x_rows, x_live, w_rows, s_rows, stride_xk, kt_lo, kt_hi, K,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, X_MMA_ORDER: tl.constexpr = False):
    """``acc [BN, BM] += dq(W)[rows, k] @ x[rows, k]^T`` over K tiles ``kt_lo..kt_hi``.

    ``x_rows [1, BM]``, ``w_rows [BN, 1]`` and ``s_rows [BN, 1]`` point at the first element of each
    row of x, of the packed codes (int32 words) and of the scale bytes. Token columns outside
    ``x_live [1, BM]`` load zeros without touching memory (one token must not cost 16 rows of
    traffic); out-of-range K is masked to 0 on both operands. With ``X_MMA_ORDER`` x's rows are
    already in :func:`mma_k_order_x`'s K order (:func:`mma_k_order_rows`), so the tile goes to the dot as loaded.
    """
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_s = tl.arange(0, BLOCK_K // 16)
    for kt in range(kt_lo, kt_hi):
        k0 = kt * BLOCK_K
        x_ptrs = x_rows + (k0 + offs_k)[:, None] * stride_xk
        w_ptrs = w_rows + (k0 // 8 + offs_w)[None, :]
        s_ptrs = s_rows + (k0 // 16 + offs_s)[None, :]
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=x_live, other=0.0)
            packed = tl.load(w_ptrs)
            sb = tl.load(s_ptrs)
        else:
            xt = tl.load(x_ptrs, mask=x_live & ((k0 + offs_k)[:, None] < K), other=0.0)
            packed = tl.load(w_ptrs, mask=(k0 // 8 + offs_w)[None, :] < K // 8, other=0)
            sb = tl.load(s_ptrs, mask=(k0 // 16 + offs_s)[None, :] < K // 16, other=0)
        w = dequant_mma_tile(packed, sb)
        if not X_MMA_ORDER:
            xt = mma_k_order_x(xt)
        if DOT_F32:  # the interpreter's bf16 tl.dot multiplies raw bit patterns; fp32 is exact here
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    return acc


@triton.jit
def mma_k_order_position(cols, BLOCK_K: tl.constexpr):
    """Where :func:`mma_k_order_rows` puts column ``cols`` of a row: within its ``BLOCK_K`` run,
    element ``8 (I t + i) + 4 h + 2 q1 + q0`` goes to ``32 i + 16 q1 + 8 q0 + 2 t + h``."""
    I: tl.constexpr = BLOCK_K // 32
    e = cols % BLOCK_K
    q0 = e & 1
    q1 = (e >> 1) & 1
    h = (e >> 2) & 1
    i = (e >> 3) % I
    t = (e >> 3) // I
    return cols - e + 32 * i + 16 * q1 + 8 * q0 + 2 * t + h


@triton.jit
def _store_output(acc, ws2_ptr, y_ptr, offs_n, offs_m, N, m_end, stride_yn, stride_ym, row_scale_ptr=None,
                  ROW_SCALE: tl.constexpr = False, Y_MMA_ORDER: tl.constexpr = False):
    """Epilogue: ``y[m, n] = cast(acc[n, m] * weight_scale_2)`` for ``n < N`` and ``m < m_end``; with
    ``ROW_SCALE`` the factor is ``row_scale[m] * weight_scale_2`` (the W4A4 ``alpha``). ``Y_MMA_ORDER``
    writes column ``n`` where :func:`mma_k_order_rows` (:data:`X_ORDER_BLOCK_K`) would put it (N is
    then a multiple of that block)."""
    DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    if ROW_SCALE:
        alpha = tl.load(row_scale_ptr + offs_m, mask=offs_m < m_end, other=0.0) * tl.load(ws2_ptr)
        decode = (alpha * (2.0 ** -OPERAND_LOG2_SCALE))[None, :]  # exact power-of-two rescale
    else:
        decode = tl.load(ws2_ptr) * (2.0 ** -OPERAND_LOG2_SCALE)
    y = round_f32_to(acc * decode, DTYPE)
    cols = mma_k_order_position(offs_n, _X_ORDER_BLOCK) if Y_MMA_ORDER else offs_n
    ptrs = y_ptr + offs_m[None, :] * stride_ym + cols[:, None] * stride_yn
    tl.store(ptrs, y, mask=(offs_n[:, None] < N) & (offs_m[None, :] < m_end))


@triton.jit
def _dense_kernel(
    x_ptr, codes_ptr, scales_ptr, ws2_ptr, y_ptr, partials_ptr, counters_ptr,
    tail_codes_ptr, tail_scales_ptr, row_scale_ptr,
    M, N, K, K2,
    stride_xm, stride_xk, stride_cn, stride_sn, stride_ym, stride_yn, stride_tcn, stride_tsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_K2: tl.constexpr, HAS_TAIL: tl.constexpr, DOT_F32: tl.constexpr, ROW_SCALE: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))``: one K slice of one ``y^T`` tile.

    With ``HAS_TAIL`` (``K2 > 0``) the reduction runs over an augmented K: x rows hold ``K + K2`` values and the
    second weight (``tail_*``, ``[N, K2]``, the same ``weight_scale_2``) covers columns ``K..K+K2``
    (the RAC residual part); every split takes its share of both ranges.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # weight rows past N are clamped (valid, unmasked loads) and dropped by the store mask
    rows_n = tl.minimum(offs_n, N - 1)
    rows_m = tl.minimum(offs_m, M - 1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt_lo = pid_k * per_split
    kt_hi = tl.minimum(kt_lo + per_split, k_tiles)

    x_rows = x_ptr + rows_m[None, :] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = _accumulate(
        acc, x_rows, offs_m[None, :] < M,
        codes_ptr + rows_n[:, None] * stride_cn,
        scales_ptr + rows_n[:, None] * stride_sn,
        stride_xk, kt_lo, kt_hi, K, BLOCK_K, EVEN_K, DOT_F32,
    )
    if HAS_TAIL:
        tail_tiles = tl.cdiv(K2, BLOCK_K)
        tail_per_split = tl.cdiv(tail_tiles, SPLIT_K)
        acc = _accumulate(
            acc, x_rows + K * stride_xk, offs_m[None, :] < M,
            tail_codes_ptr + rows_n[:, None] * stride_tcn,
            tail_scales_ptr + rows_n[:, None] * stride_tsn,
            stride_xk, pid_k * tail_per_split, tl.minimum((pid_k + 1) * tail_per_split, tail_tiles), K2,
            BLOCK_K, EVEN_K2, DOT_F32,
        )
    if SPLIT_K == 1:
        _store_output(acc, ws2_ptr, y_ptr, offs_n, offs_m, N, M, stride_yn, stride_ym, row_scale_ptr, ROW_SCALE)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        TILE: tl.constexpr = BLOCK_N * BLOCK_M
        local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        base = partials_ptr + tile.to(tl.int64) * (SPLIT_K * TILE)
        tl.store(base + pid_k * TILE + local, acc)
        # every thread's partial is stored before one thread's gpu-scope release (CUTLASS semaphore)
        tl.debug_barrier()
        arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order: the result does not depend on timing
                total += tl.load(base + s * TILE + local, cache_modifier=".cg")
            _store_output(total, ws2_ptr, y_ptr, offs_n, offs_m, N, M, stride_yn, stride_ym, row_scale_ptr, ROW_SCALE)
            tl.atomic_xchg(counters_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _grouped_rows(
    acc, x_ptr, w_rows, s_rows, ws2_ptr, y_ptr, tail_w_rows, tail_s_rows, row_scale_ptr, offs_n, m0, hi, N, K, K2,
    stride_xm, stride_xk, stride_ym, stride_yn,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_K2: tl.constexpr, HAS_TAIL: tl.constexpr,
    DOT_F32: tl.constexpr, ROW_SCALE: tl.constexpr, X_MMA_ORDER: tl.constexpr, Y_MMA_ORDER: tl.constexpr,
):
    """One token tile of an expert: rows ``m0 .. m0 + acc.shape[1]`` (those below ``hi``), the whole K
    (and the tail), stored through the epilogue. ``acc`` is a zero tile whose shape sets the tile."""
    offs_m = m0 + tl.arange(0, acc.shape[1])
    rows_m = tl.minimum(offs_m, hi - 1)
    x_rows = x_ptr + rows_m[None, :] * stride_xm
    live = offs_m[None, :] < hi
    acc = _accumulate(acc, x_rows, live, w_rows, s_rows, stride_xk, 0, tl.cdiv(K, BLOCK_K), K,
                      BLOCK_K, EVEN_K, DOT_F32, X_MMA_ORDER)
    if HAS_TAIL:
        acc = _accumulate(acc, x_rows + K * stride_xk, live, tail_w_rows, tail_s_rows,
                          stride_xk, 0, tl.cdiv(K2, BLOCK_K), K2, BLOCK_K, EVEN_K2, DOT_F32, X_MMA_ORDER)
    _store_output(acc, ws2_ptr, y_ptr, offs_n, offs_m, N, hi, stride_yn, stride_ym, row_scale_ptr, ROW_SCALE, Y_MMA_ORDER)


@triton.jit
def _grouped_kernel(
    x_ptr, codes_ptr, scales_ptr, ws2_ptr, offsets_ptr, y_ptr, tail_codes_ptr, tail_scales_ptr, row_scale_ptr,
    N, K, K2,
    stride_xm, stride_xk, stride_ce, stride_cn, stride_se, stride_sn, stride_w2, stride_ym, stride_yn,
    stride_tce, stride_tcn, stride_tse, stride_tsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_K2: tl.constexpr, HAS_TAIL: tl.constexpr, DOT_F32: tl.constexpr, ROW_SCALE: tl.constexpr,
    X_MMA_ORDER: tl.constexpr = False, HALF_TILE: tl.constexpr = False, Y_MMA_ORDER: tl.constexpr = False,
):
    """Grid ``(cdiv(N, BLOCK_N), E)``: expert ``e``'s rows ``offsets[e]:offsets[e+1]``, one N tile;
    ``HAS_TAIL`` and ``ROW_SCALE`` as in :func:`_dense_kernel` (the tail weight stacked ``[E, N, K2]``).
    ``HALF_TILE``: an expert with at most ``BLOCK_M / 2`` rows runs one half-width token tile, so its
    MMA is half as wide (the routed rows per expert scatter around their mean, and the token tile is
    sized for the larger experts)."""
    pid_n = tl.program_id(0)
    expert = tl.program_id(1)
    lo = tl.load(offsets_ptr + expert)
    hi = tl.load(offsets_ptr + expert + 1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, N - 1)
    e64 = expert.to(tl.int64)
    w_rows = codes_ptr + e64 * stride_ce + rows_n[:, None] * stride_cn
    s_rows = scales_ptr + e64 * stride_se + rows_n[:, None] * stride_sn
    tail_w_rows = tail_codes_ptr + e64 * stride_tce + rows_n[:, None] * stride_tcn
    tail_s_rows = tail_scales_ptr + e64 * stride_tse + rows_n[:, None] * stride_tsn
    ws2 = ws2_ptr + expert * stride_w2
    if HALF_TILE and hi - lo <= BLOCK_M // 2:
        for m0 in range(lo, hi, BLOCK_M // 2):  # one iteration, none for an expert without rows
            _grouped_rows(
                tl.zeros((BLOCK_N, BLOCK_M // 2), dtype=tl.float32), x_ptr, w_rows, s_rows, ws2, y_ptr,
                tail_w_rows, tail_s_rows, row_scale_ptr, offs_n, m0, hi, N, K, K2, stride_xm, stride_xk, stride_ym,
                stride_yn, BLOCK_K, EVEN_K, EVEN_K2, HAS_TAIL, DOT_F32, ROW_SCALE, X_MMA_ORDER, Y_MMA_ORDER,
            )
    else:
        for m0 in range(lo, hi, BLOCK_M):
            _grouped_rows(
                tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), x_ptr, w_rows, s_rows, ws2, y_ptr,
                tail_w_rows, tail_s_rows, row_scale_ptr, offs_n, m0, hi, N, K, K2, stride_xm, stride_xk, stride_ym,
                stride_yn, BLOCK_K, EVEN_K, EVEN_K2, HAS_TAIL, DOT_F32, ROW_SCALE, X_MMA_ORDER, Y_MMA_ORDER,
            )


# --------------------------------------------------------------------------------------------------
# Configs and autotuning
# --------------------------------------------------------------------------------------------------


def _config(block_n: int, block_k: int, split_k: int | None, num_warps: int, num_stages: int) -> triton.Config:
    meta = {"BLOCK_N": block_n, "BLOCK_K": block_k}
    if split_k is not None:
        meta["SPLIT_K"] = split_k
    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages)


def _dense_configs(splits: tuple[int, ...]) -> list[triton.Config]:
    if _INTERPRET:
        return [_config(32, 64, max(splits[:2]), 4, 1)]
    # (BLOCK_N, BLOCK_K, warps, stages); benchmarks/bench_kernels.py --only w4a16 times what the
    # autotuner picks among them
    tiles = ((64, 128, 4, 4), (64, 256, 4, 4), (128, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 4), (128, 256, 8, 4), (256, 128, 8, 4))
    return [_config(bn, bk, s, w, st) for bn, bk, w, st in tiles for s in splits]


GROUPED_TILES = {16: (128, 128, 4, 4), 32: (128, 128, 4, 3), 64: (128, 128, 4, 3)}
"""The grouped kernel's (BLOCK_N, BLOCK_K, num_warps, num_stages) per token tile (``BLOCK_M``): the
fastest or within 3% of it at every decode size of Qwen3-30B-A3B's expert shapes (8..512 tokens, top-8
of 128, gate/up and down) in a sweep of 36 tiles on an H200 (``tools/tune_grouped_w4a16.py``,
benchmarks/results/grouped_tiles_gpu.json). Fixed rather than autotuned: an engine's warm-up forward
routes every token to the same experts, and tiles tuned on that routing ran the real one up to 1.4x
slower."""

_INTERPRET_GROUPED_TILE = (32, 64, 4, 1)
"""A small tile under ``TRITON_INTERPRET=1`` (the interpreter's time grows with the tile)."""


def grouped_tile(block_m: int, x_mma_order: bool) -> dict[str, int]:
    """The grouped kernel's launch config for token tile ``block_m`` (:data:`GROUPED_TILES`); with
    ``x_mma_order`` its ``BLOCK_K`` is :data:`X_ORDER_BLOCK_K`, the block of x's K order."""
    bn, bk, warps, stages = _INTERPRET_GROUPED_TILE if _INTERPRET else GROUPED_TILES[block_m]
    return {"BLOCK_N": bn, "BLOCK_K": X_ORDER_BLOCK_K if x_mma_order else bk, "num_warps": warps, "num_stages": stages}


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dense_programs(meta: dict[str, Any], m: int, n: int, block_m: int) -> int:
    return triton.cdiv(n, meta["BLOCK_N"]) * meta["SPLIT_K"] * triton.cdiv(m, block_m)


def _prune_dense(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
    """Keep the split-K configs whose program count lies in the window (or the nearest ones).

    Splits need at least one K tile each. Depends only on the autotuning key (token bucket, N, K)
    and the SM count, so every input of one key sees the same list. Configs without split-K (the
    large-M autotuner) are all kept.
    """
    m, n, k = named_args["M"], named_args["N"], named_args["K"]
    block_m = kwargs["BLOCK_M"]
    valid = [c for c in configs if c.kwargs["SPLIT_K"] <= triton.cdiv(k, c.kwargs["BLOCK_K"])] or configs[:1]
    if all(c.kwargs["SPLIT_K"] == 1 for c in valid):
        return valid
    sms = _sm_count(named_args["x_ptr"].device)
    lo, hi = _SPLIT_WINDOW[0] * sms, _SPLIT_WINDOW[1] * sms

    def distance(c: triton.Config) -> float:
        p = _dense_programs(c.kwargs, m, n, block_m)
        return max(lo - p, p - hi, 0.0)

    best = min(distance(c) for c in valid)
    return [c for c in valid if distance(c) == best]


def _even_k(args: dict[str, Any]) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


def _even_k2(args: dict[str, Any]) -> bool:
    return args["K2"] % args["BLOCK_K"] == 0


def _has_tail(args: dict[str, Any]) -> bool:
    return args["K2"] > 0


_dense_heuristic = triton.heuristics({"EVEN_K": _even_k, "EVEN_K2": _even_k2, "HAS_TAIL": _has_tail})(_dense_kernel)
_dense_tuned = triton.autotune(
    configs=_dense_configs((1, 2, 4, 8, 16)),
    key=["BLOCK_M", "N", "K", "K2"],
    prune_configs_by={"early_config_prune": _prune_dense},
)(_dense_heuristic)
_dense_tuned_large = triton.autotune(
    configs=_dense_configs((1,)),
    key=["BLOCK_M", "N", "K", "K2"],
    prune_configs_by={"early_config_prune": _prune_dense},
)(_dense_heuristic)
def _half_tile(args: dict[str, Any]) -> bool:
    """The half-width token tile applies from ``BLOCK_M`` 32 on (a dot needs at least 16 columns)."""
    return args["BLOCK_M"] >= 32


_grouped_heuristic = triton.heuristics(
    {"EVEN_K": _even_k, "EVEN_K2": _even_k2, "HAS_TAIL": _has_tail, "HALF_TILE": _half_tile})(_grouped_kernel)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------


def _block_m(rows: int) -> int:
    """Token tile (the MMA's N side): the smallest of 16, 32, 64 that covers ``rows``."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def _check_weight_parts(x: torch.Tensor, weight: NVFP4Tensor, in_features: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _KERNEL_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"W4A16 kernels take bfloat16 activations, got {got}: use the reference path")
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {in_features} (weight shape {tuple(weight.shape)})")
    if weight.codes.dtype != torch.uint8 or weight.scales.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"weight codes must be uint8 and scales float8_e4m3fn, got {weight.codes.dtype} and {weight.scales.dtype}")
    tensors = (x, weight.codes, weight.scales, weight.weight_scale_2)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"x and the weight's tensors must share one device, got {[str(t.device) for t in tensors]}")


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride along its last dim (the kernels index bytes within a row directly)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _code_words(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes (uint8 ``[..., K/2]``) viewed as int32 words of 8 codes, copied only if misaligned."""
    if codes.stride(-1) != 1 or codes.storage_offset() % 4 or any(s % 4 for s in codes.stride()[:-1]):
        codes = codes.contiguous()
    return codes.view(torch.int32)


def _check_config(config: dict[str, int] | None) -> None:
    if config is not None and (config["BLOCK_K"] < 64 or config["BLOCK_K"] % 64):
        raise ValueError(f"BLOCK_K must be a multiple of 64 (each thread dequantizes pairs of 32-code runs), got {config['BLOCK_K']}")


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    if tuple(out.shape) != shape or out.dtype not in dtypes or out.device != device:
        names = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"out must be a {names} tensor of shape {shape} on {device}, got {out.dtype} {tuple(out.shape)} on {out.device}")


def _operands(weight: NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels read of an NVFP4 weight: its codes as int32 words and its scale bytes (uint8),
    rows with unit stride."""
    return _code_words(weight.codes), _rows_contiguous(weight.scales.view(torch.uint8))


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for split-K, one buffer per device.

    Every launch leaves them at 0 again, so they are allocated (and zeroed) only when they grow; a
    CUDA graph captured after one eager call reuses them. Launches on two streams at once would
    share the counters: run split-K linears of one device on one stream at a time.
    """
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("w4a16 split-K counters must be allocated before CUDA graph capture: run the layer once eagerly first")
        buf = torch.zeros(max(count, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _new_partials(numel: int, device: torch.device) -> torch.Tensor:
    """fp32 split-K partial tiles (no initialisation needed: every slot read was written)."""
    return torch.empty(numel, dtype=torch.float32, device=device)


def _launch_dense(x2: torch.Tensor, weight: NVFP4Tensor, y2: torch.Tensor, config: dict[str, int] | None,
                  tail: NVFP4Tensor | None = None, row_scale: torch.Tensor | None = None) -> None:
    """Launch the dense kernel on ``x2 [M, K (+ K2)]``; ``tail [N, K2]`` extends the reduction over the
    last ``K2`` columns of x, ``row_scale [M]`` (fp32) multiplies each output row."""
    m = x2.shape[0]
    k = weight.shape[1]
    n = weight.shape[0]
    codes, scales = _operands(weight)
    tail_codes, tail_scales = (codes, scales) if tail is None else _operands(tail)  # never read without a tail
    k2 = 0 if tail is None else tail.shape[1]
    ws2 = weight.weight_scale_2.reshape(1).to(torch.float32)
    block_m = _block_m(m)
    m_tiles = triton.cdiv(m, block_m)
    common = {"BLOCK_M": block_m, "DOT_F32": _INTERPRET and x2.dtype == torch.bfloat16, "ROW_SCALE": row_scale is not None}
    tuner = _dense_tuned if m <= _MAX_SPLIT_M else _dense_tuned_large
    # sized for any config the autotuner may pick (it caches one per key, whatever M in the bucket)
    metas = [c.kwargs for c in tuner.configs] if config is None else [config]
    max_split = max(meta["SPLIT_K"] for meta in metas)
    padded_n = max(triton.cdiv(n, meta["BLOCK_N"]) * meta["BLOCK_N"] for meta in metas)
    partials = _new_partials(max_split * padded_n * m_tiles * block_m if max_split > 1 else 1, x2.device)
    counters = _split_counters(x2.device, triton.cdiv(n, min(meta["BLOCK_N"] for meta in metas)) * m_tiles)
    args = (
        x2, codes, scales, ws2, y2, partials, counters, tail_codes, tail_scales, ws2 if row_scale is None else row_scale,
        m, n, k, k2,
        x2.stride(0), x2.stride(1), codes.stride(0), scales.stride(0), y2.stride(0), y2.stride(1),
        tail_codes.stride(0), tail_scales.stride(0),
    )

    def grid(meta: dict[str, Any]) -> tuple[int, int, int]:
        return (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"], m_tiles)

    if config is None:
        tuner[grid](*args, **common)
    else:
        launch = {key: config[key] for key in ("BLOCK_N", "BLOCK_K", "SPLIT_K")}
        _dense_heuristic[grid](*args, **common, **launch, num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 3))


def w4a16_linear_into(
    x: torch.Tensor, weight: NVFP4Tensor, out: torch.Tensor, config: dict[str, Any] | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Write ``x @ dq(W).T`` into ``out [..., N]`` (``x.dtype``) and return it.

    ``kernel``: None follows :mod:`~megatron_quads.kernels.dispatch` (on sm_90 up to 16 rows with K a
    multiple of 256 the warp-specialized dense kernel, else the Triton one), ``"triton"`` or ``"ws"``
    picks one (``"ws"`` raises ``ValueError`` where it cannot run). ``config`` is the chosen kernel's:
    for Triton ``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K``, optional ``num_warps``/``num_stages`` (skipping
    its autotuner, which keys on token bucket, N and K), for ``"ws"`` see
    :func:`~megatron_quads.kernels.w4a16_ws_dense.w4a16_ws_linear_into`; a config without ``kernel``
    runs the Triton kernel.
    """
    if len(weight.shape) != 2:
        raise ValueError(f"w4a16_linear_kernel needs an [N, K] weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    _check_weight_parts(x, weight, k)
    _check_out(out, (*x.shape[:-1], n), (x.dtype,), x.device)
    x2 = _rows_contiguous(x.reshape(-1, k))
    y2 = out.view(-1, n)
    if resolve_dense_w4a16(kernel, config, x2, k, y2) == "ws":
        gluon_module("w4a16_ws_dense").w4a16_ws_linear_into(x2, weight, y2, config)
        return out
    _check_config(config)
    if out.numel():
        _launch_dense(x2, weight, y2, config)
    return out


def w4a16_linear_kernel(x: torch.Tensor, weight: NVFP4Tensor) -> torch.Tensor:
    """``y = x @ dq(W).T`` for bf16 ``x [..., K]`` and an NVFP4 ``[N, K]`` weight: ``[..., N]``.

    Matches :func:`megatron_quads.rollout.w4a4.w4a16_linear` up to fp32 summation order. Raises
    ``TypeError`` for other activation dtypes (the caller falls back to the reference).
    """
    if isinstance(x, torch.Tensor) and x.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"W4A16 kernels take bfloat16 activations, got {x.dtype}: use the reference path")
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    return w4a16_linear_into(x, weight, out)


def w4a16_augmented_into(
    values: torch.Tensor, weight: NVFP4Tensor, tail: NVFP4Tensor | None, row_scale: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out [M, N] = (values @ dq([W, W_tail]).T) * row_scale[:, None]`` in one reduction over ``K + K2``.

    The W4A4 + RAC decode path: ``values`` (bf16 ``[M, K + K2]``) are the activations' block values
    (``e2m1 * e4m3``, exact in bf16) of ``[q(x), q(r_S)]``, ``weight [N, K]`` and ``tail [N, K2]``
    (the residual weight W_S, or None when ``K2 = 0``) share ``weight.weight_scale_2``, and
    ``row_scale`` (fp32 ``[M]``) is each row's activation decode scale. ``out`` may be bf16, fp16 or fp32.
    """
    if len(weight.shape) != 2:
        raise ValueError(f"w4a16_augmented_into needs an [N, K] weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    k2 = 0 if tail is None else tail.shape[-1]
    if tail is not None and tuple(tail.shape) != (n, k2):
        raise ValueError(f"the tail weight must be [{n}, K2], got shape {tuple(tail.shape)}")
    _check_weight_parts(values, weight, k + k2)
    m = values.shape[0]
    if values.ndim != 2 or row_scale.shape != (m,) or row_scale.dtype != torch.float32:
        raise ValueError(f"values must be [M, {k + k2}] with a float32 row_scale [M], got {tuple(values.shape)} and "
                         f"{row_scale.dtype} {tuple(row_scale.shape)}")
    _check_out(out, (m, n), _OUT_DTYPES, values.device)
    if m:
        _launch_dense(_rows_contiguous(values), weight, out, None, tail, row_scale)
    return out


def check_grouped_bf16_call(x: torch.Tensor, weight: NVFP4Tensor, expert_offsets: torch.Tensor,
                            out: torch.Tensor, out_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
                            ) -> tuple[int, int, int]:
    """The argument checks the Gluon grouped kernels share (bf16 in, ``out_dtypes`` out): x ``[T, K]``
    against the stacked ``[E, N, K]`` weight, int32 offsets, one or ``E`` decode scales, out ``[T, N]``;
    returns ``(E, N, K)``."""
    from megatron_quads.nvfp4.stacked import check_grouped_shapes

    check_grouped_shapes(x, weight, expert_offsets)
    num_experts, n, k = weight.shape
    _check_weight_parts(x, weight, k)
    if expert_offsets.dtype != torch.int32:
        raise ValueError(f"expert_offsets must be int32, got {expert_offsets.dtype}")
    if weight.weight_scale_2.numel() not in (1, num_experts):
        raise ValueError(f"weight_scale_2 must hold 1 or {num_experts} values, got shape {tuple(weight.weight_scale_2.shape)}")
    _check_out(out, (x.shape[0], n), out_dtypes, x.device)
    return num_experts, n, k


def _grouped_block_m(rows: int, experts: int) -> int:
    """Row chunk per expert from the mean rows per expert (known without a device sync)."""
    return _block_m(2 * triton.cdiv(rows, max(experts, 1)))


def grouped_w4a16_into(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    expert_offsets: torch.Tensor,
    out: torch.Tensor,
    config: dict[str, int] | None = None,
    tail: NVFP4Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    x_mma_order: bool = False,
    y_mma_order: bool = False,
    kernel: str | None = None,
) -> torch.Tensor:
    """Write the grouped W4A16 product into ``out [T, N]`` and return it (see :func:`grouped_w4a16_kernel`).

    Only shapes are checked (no host synchronisation): ``expert_offsets`` must rise from 0 to ``T``.
    ``kernel``: None follows :mod:`~megatron_quads.kernels.dispatch` (on sm_90 x-in-K-order calls, a
    tail permitting, run the warp-specialized grouped kernel, others the Triton one), ``"triton"``
    or ``"ws"`` picks one (``"ws"`` raises ``ValueError`` where it cannot run). ``config`` is the
    chosen kernel's: for Triton ``BLOCK_N``, ``BLOCK_K``, optional ``BLOCK_M``/``num_warps``/
    ``num_stages`` (instead of :func:`grouped_tile`), for ``"ws"`` see
    :func:`~megatron_quads.kernels.w4a16_ws.grouped_w4a16_ws_into`; a config without ``kernel`` runs
    the Triton kernel.
    ``x_mma_order`` says x's rows are already in the kernel's K order for :data:`X_ORDER_BLOCK_K`
    (:func:`mma_k_order_rows`): x tiles then go from shared memory to the MMA as loaded, and every
    config (the default or a given one) uses that ``BLOCK_K``. ``y_mma_order`` writes each row of ``out`` in
    that K order (``mma_k_order_rows(y, X_ORDER_BLOCK_K)``, N a multiple of the block): an elementwise
    op on it (the MoE's ``act(gate) * up``) then yields the next grouped GEMM's ``x_mma_order`` input.
    ``tail`` (stacked ``[E, N, K2]``, the weight's ``weight_scale_2``) and ``row_scale`` (fp32 ``[T]``)
    make it the grouped W4A4 + RAC decode GEMM, as :func:`w4a16_augmented_into` does for one weight:
    x then holds ``K + K2`` values a row (with ``x_mma_order`` both parts in the K order, ``K2`` a
    multiple of the block).
    """
    from megatron_quads.nvfp4.stacked import check_grouped_shapes

    check_grouped_shapes(x if tail is None else x[..., : weight.shape[-1]], weight, expert_offsets)
    num_experts, n, k = weight.shape
    k2 = 0 if tail is None else tail.shape[-1]
    if tail is not None and tuple(tail.shape) != (num_experts, n, k2):
        raise ValueError(f"the tail weight must be [{num_experts}, {n}, K2], got shape {tuple(tail.shape)}")
    if row_scale is not None and (row_scale.shape != (x.shape[0],) or row_scale.dtype != torch.float32):
        raise ValueError(f"row_scale must be float32 [{x.shape[0]}], got {row_scale.dtype} {tuple(row_scale.shape)}")
    _check_weight_parts(x, weight, k + k2)
    if expert_offsets.dtype != torch.int32:
        raise ValueError(f"expert_offsets must be int32, got {expert_offsets.dtype}")
    if weight.weight_scale_2.numel() not in (1, num_experts):
        raise ValueError(f"weight_scale_2 must hold 1 or {num_experts} values, got shape {tuple(weight.weight_scale_2.shape)}")
    # the RAC path (row_scale) writes the caller's dtype; plain W4A16 writes x's
    _check_out(out, (x.shape[0], n), (x.dtype,) if row_scale is None else _OUT_DTYPES, x.device)
    if x_mma_order and (k % X_ORDER_BLOCK_K or k2 % X_ORDER_BLOCK_K):
        raise ValueError(f"x_mma_order needs K % {X_ORDER_BLOCK_K} == 0 and the tail's K2 % {X_ORDER_BLOCK_K} == 0 "
                         f"(got K={k}, K2={k2})")
    if y_mma_order and n % X_ORDER_BLOCK_K:
        raise ValueError(f"y_mma_order needs N % {X_ORDER_BLOCK_K} == 0 (whole K-order blocks), got N={n}")
    if resolve_grouped_w4a16(kernel, config, x, k, k2, x_mma_order) == "ws":
        if out.numel() == 0:
            return out
        return gluon_module("w4a16_ws").grouped_w4a16_ws_into(x, weight, expert_offsets.to(x.device), out, config,
                                                              y_mma_order=y_mma_order, tail=tail, row_scale=row_scale)
    _check_config(config)
    if x_mma_order and config is not None and config["BLOCK_K"] != X_ORDER_BLOCK_K:
        raise ValueError(f"x_mma_order needs BLOCK_K {X_ORDER_BLOCK_K} in a given config, got {config['BLOCK_K']}")
    if out.numel() == 0:
        return out
    x = _rows_contiguous(x)
    codes, scales = _operands(weight)
    tail_codes, tail_scales = (codes, scales) if tail is None else _operands(tail)  # never read without a tail
    ws2 = weight.weight_scale_2.reshape(-1).to(torch.float32)
    offsets = expert_offsets.to(x.device)
    block_m = _grouped_block_m(x.shape[0], num_experts) if config is None else config.get("BLOCK_M", 16)
    args = (
        x, codes, scales, ws2, offsets, out, tail_codes, tail_scales, ws2 if row_scale is None else row_scale, n, k, k2,
        x.stride(0), x.stride(1), codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1),
        1 if ws2.numel() > 1 else 0, out.stride(0), out.stride(1),
        tail_codes.stride(0), tail_codes.stride(1), tail_scales.stride(0), tail_scales.stride(1),
    )
    common = {"BLOCK_M": block_m, "DOT_F32": _INTERPRET and x.dtype == torch.bfloat16, "ROW_SCALE": row_scale is not None,
              "X_MMA_ORDER": x_mma_order, "Y_MMA_ORDER": y_mma_order}

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(n, meta["BLOCK_N"]), num_experts)

    tile = grouped_tile(block_m, x_mma_order) if config is None else {
        "BLOCK_N": config["BLOCK_N"], "BLOCK_K": config["BLOCK_K"], "num_warps": config.get("num_warps", 4),
        "num_stages": config.get("num_stages", 3)}
    _grouped_heuristic[grid](*args, **common, **tile)
    return out


def grouped_w4a16_kernel(x: torch.Tensor, weight: NVFP4Tensor, expert_offsets: torch.Tensor,
                         x_mma_order: bool = False, y_mma_order: bool = False) -> torch.Tensor:
    """Grouped MoE W4A16: ``y[rows of e] = x[rows of e] @ dq(W_e).T`` for every expert, ``[T, N]``.

    ``x [T, K]`` bf16 sorted by expert (with ``x_mma_order``, each row already in the kernel's K
    order: :func:`mma_k_order_rows` with :data:`X_ORDER_BLOCK_K`), ``weight`` stacked ``[E, N, K]``
    with ``weight_scale_2`` ``[E]``, ``[E, 1]`` or one shared value, ``expert_offsets`` int32
    ``[E + 1]``; ``y_mma_order``: the output's rows in that K order (see :func:`grouped_w4a16_into`).
    Launches without a host sync; matches
    :func:`megatron_quads.rollout.grouped.grouped_w4a16_linear` up to fp32 summation order.
    """
    if isinstance(x, torch.Tensor) and x.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"W4A16 kernels take bfloat16 activations, got {x.dtype}: use the reference path")
    out = torch.empty(x.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    return grouped_w4a16_into(x, weight, expert_offsets, out, x_mma_order=x_mma_order, y_mma_order=y_mma_order)

