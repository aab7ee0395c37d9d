"""Experimental decode W4A16 kernel in Gluon: mma.sync on register operands.

Not dispatched (the Triton kernels of :mod:`megatron_quads.kernels.w4a16` are): measured on
the H200 (``benchmarks/bench_kernels.py --only w4a16_mma``, docs/kernels.md) it is within 5% of them
at M <= 16 (faster with ``X_SMEM``) and slower beyond, far from the targets either way, so it stays
as the measured alternative for the next design.

Why: the Triton decode kernel runs wgmma, whose B operand (x) must sit in shared memory, so every K
step copies x in, reorders it and synchronizes twice; with two CTAs per SM the profile reads as
latency-bound at ~45% of the byte floor (docs/kernels.md). Here both MMA operands live in registers:

* the weight words are loaded so that each thread holds exactly the words its mma.sync A fragments
  need (the same K permutation as :func:`~megatron_quads.kernels.w4a16.dequant_mma_tile`:
  thread ``t`` takes the ``I = BK/32`` consecutive words ``I t .. I t + I - 1`` of a row), and the
  dequantized bf16 values become the A operand by a register renaming only (``convert_layout(...,
  assert_trivial=True)`` proves at compile time that no data moves between threads);
* x is read from global memory (L2-resident at decode) straight into the B fragments: each thread's
  ``8 I`` values of a token row are one contiguous run (16-byte vector loads), permuted in registers;
* the next K step's words, scales and x are loaded before the current step is dequantized and
  multiplied (register double buffering), and split-K partials are reduced by the last program to
  arrive, as in the Triton kernel.

No barrier and no shared memory in the K loop: warps run independently, so small CTAs (1-2 warps)
and many of them per SM hide the DRAM latency instead of a pipeline of shared-memory stages. The
alternative, ``STAGES > 0``, puts the weights through such a pipeline (:func:`_k_loop_staged`);
it measured slower at every shape tried. ``X_SMEM = 1`` instead copies each program's x slice into
shared memory once for all its warps (:func:`_k_loop_x_slice`): x's global loads leave the loop.
bf16 activations, 8 to 32 tokens per tile, ``K % BLOCK_K == 0``; the same operands and fp32
accumulation as the Triton kernel (results equal up to fp32 summation order).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from megatron_quads.kernels import w4a16 as _triton_w4a16
from megatron_quads.kernels.w4a16 import (
    _DEQUANT_WORD_PTX,
    _SCALE_HALF_PTX,
    _SCALE_PAIRS_PTX,
    OPERAND_LOG2_SCALE,
    _check_out,
    _check_weight_parts,
    _operands,
    _split_counters,
    check_grouped_bf16_call,
)
from megatron_quads.nvfp4.tensor import NVFP4Tensor

_SCALE_PAIRS_2_PTX = gl.constexpr(
    "{\n.reg .b32 w, v, t, u, c;\nmov.b32 c, 0x7B007B00;\ncvt.u32.u16 w, $2;"
    + _SCALE_HALF_PTX.replace("$4", "w").format(select="0x4140", lo=0, hi=1)
    + "}\n"
)
"""Two E4M3 scale bytes (one 16-bit register) to two bf16x2 pairs: :data:`_SCALE_PAIRS_PTX` for the
2-byte runs of a thread at ``BLOCK_K = 128`` (its 4-byte form would first gather bytes of two rows)."""


@gluon.constexpr_function
def _bits(n: int) -> list[int]:
    return [1 << b for b in range(n.bit_length() - 1)]


@gluon.constexpr_function
def _basis(rank: int, dim: int, value: int) -> list[int]:
    out = [0] * rank
    out[dim] = value
    return out


@gluon.constexpr_function
def mma_layout(num_warps: int) -> gl.NVMMADistributedLayout:
    """fp32 accumulator ``[BN, BM]`` of mma.sync m16n8k16, warps stacked along the weight rows."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def operand_layout(index: int, num_warps: int) -> gl.DotOperandLayout:
    """The A (0: dequantized weights) or B (1: x) operand of :func:`mma_layout`'s mma.sync."""
    return gl.DotOperandLayout(operand_index=index, parent=mma_layout(num_warps), k_width=2)


@gluon.constexpr_function
def _row_bases(block_n: int, num_warps: int, rank: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """How the A fragments spread ``block_n`` weight rows: (lane, register, warp) bases.

    Lanes 2-4 take rows 1, 2, 4 (the fragment's group id), one register row 8, the warps rows 16,
    32, ..., and the remaining register bits the repeats of ``16 * num_warps`` rows.
    """
    lanes = [_basis(rank, 0, r) for r in (1, 2, 4)]
    regs = [_basis(rank, 0, 8)]
    warps = [_basis(rank, 0, 16 << w) for w in range(num_warps.bit_length() - 1)]
    regs_rep = [_basis(rank, 0, 16 * num_warps * r) for r in _bits(block_n // (16 * num_warps))]
    return lanes, regs + regs_rep, warps


@gluon.constexpr_function
def words_layout(block_n: int, block_k: int, num_warps: int) -> gl.DistributedLinearLayout:
    """int32 code words ``[BN, 4, I]`` (row, thread-in-quad ``t``, word ``i``): thread ``t`` of a
    quad holds words ``I t .. I t + I - 1`` of its rows, consecutive registers (16-byte loads)."""
    i_words = block_k // 32
    lanes, regs, warps = _row_bases(block_n, num_warps, 3)
    return gl.DistributedLinearLayout(
        reg_bases=[_basis(3, 2, b) for b in _bits(i_words)] + regs,
        lane_bases=[_basis(3, 1, 1), _basis(3, 1, 2)] + lanes,
        warp_bases=warps, block_bases=[], shape=[block_n, 4, i_words],
    )


@gluon.constexpr_function
def scale_bytes_layout(block_n: int, block_k: int, num_warps: int) -> gl.DistributedLinearLayout:
    """uint8 block scales ``[BN, 4, I/2]``: the ``I/2`` scales of a thread's ``I`` words (two words
    a 16-block), consecutive registers."""
    i_words = block_k // 32
    lanes, regs, warps = _row_bases(block_n, num_warps, 3)
    return gl.DistributedLinearLayout(
        reg_bases=[_basis(3, 2, b) for b in _bits(i_words // 2)] + regs,
        lane_bases=[_basis(3, 1, 1), _basis(3, 1, 2)] + lanes,
        warp_bases=warps, block_bases=[], shape=[block_n, 4, i_words // 2],
    )


@gluon.constexpr_function
def x_run_layout(block_k: int, block_m: int, num_warps: int) -> gl.DistributedLinearLayout:
    """bf16 x ``[4, 8 I, BM]`` (thread-in-quad ``t``, physical offset ``j`` in its run, token):
    each thread's run of ``8 I`` values of a token row in consecutive registers, tokens 1, 2, 4 on
    lanes 2-4 and 8, 16, ... in registers (the B fragments' n8 tiles), every warp holding the same
    values (each needs all of them)."""
    run = 8 * (block_k // 32)
    return gl.DistributedLinearLayout(
        reg_bases=[_basis(3, 1, b) for b in _bits(run)] + [_basis(3, 2, 8 * b) for b in _bits(block_m // 8)],
        lane_bases=[_basis(3, 0, 1), _basis(3, 0, 2), _basis(3, 2, 1), _basis(3, 2, 2), _basis(3, 2, 4)],
        warp_bases=[[0, 0, 0]] * (num_warps.bit_length() - 1), block_bases=[], shape=[4, run, block_m],
    )


@gluon.jit
def _dequant_a(words, scale_bytes, A_LAYOUT: gl.constexpr, WORDS: gl.constexpr,
               WORD_PTX: gl.constexpr = _DEQUANT_WORD_PTX):
    """Words ``[BN, 4, I]`` and scale bytes ``[BN, 4, I/2]`` to the A operand ``[BN, BK]`` (bf16
    ``e2m1 * e4m3 * 2^-8``) in MMA K order: word ``I t + i``'s nibbles ``q`` and ``q + 4``
    (``q = 2 q1 + q0``) become logical columns ``32 i + 16 q1 + 8 q0 + 2 t + (0, 1)``. ``WORD_PTX``
    decodes one word (:data:`~megatron_quads.kernels.word_layout.ROTATED_DEQUANT_WORD_PTX` for
    words in the rotated layout)."""
    BN: gl.constexpr = words.shape[0]
    I: gl.constexpr = words.shape[2]
    if I == 4:
        pairs = gl.inline_asm_elementwise(_SCALE_PAIRS_2_PTX, "=r,=r,h", [scale_bytes], dtype=gl.int32,
                                          is_pure=True, pack=2)
    else:
        pairs = gl.inline_asm_elementwise(_SCALE_PAIRS_PTX, "=r,=r,=r,=r,r", [scale_bytes], dtype=gl.int32,
                                          is_pure=True, pack=4)
    pairs = gl.convert_layout(gl.reshape(gl.join(pairs, pairs), (BN, 4, I)), WORDS, assert_trivial=True)
    o = gl.inline_asm_elementwise(WORD_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, pairs],
                                  dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
    # dims after the joins: (BN, t, i, h, q0, q1)
    v = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])), gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))
    v = gl.permute(v, (0, 2, 5, 4, 1, 3))  # (BN, i, q1, q0, t, h)
    return gl.convert_layout(gl.reshape(v, (BN, 32 * I)), A_LAYOUT, assert_trivial=True)


@gluon.jit
def _x_operand(run, B_LAYOUT: gl.constexpr):
    """x runs ``[4, 8 I, BM]`` (physical offset ``8 (I t + i) + 4 h + 2 q1 + q0``) to the B operand
    ``[BK, BM]`` in the K order of :func:`_dequant_a`."""
    I: gl.constexpr = run.shape[1] // 8
    BM: gl.constexpr = run.shape[2]
    v = gl.reshape(run, (4, I, 2, 2, 2, BM))  # (t, i, h, q1, q0, m)
    v = gl.permute(v, (1, 3, 4, 0, 2, 5))  # (i, q1, q0, t, h, m)
    return gl.convert_layout(gl.reshape(v, (32 * I, BM)), B_LAYOUT, assert_trivial=True)


@gluon.jit
def _load_weights(w_ptrs, s_ptrs, kt, BLOCK_K: gl.constexpr):
    """One K step's code words and scale bytes."""
    return gl.load(w_ptrs + kt * (BLOCK_K // 8)), gl.load(s_ptrs + kt * (BLOCK_K // 16))


@gluon.jit
def _load_step(w_ptrs, s_ptrs, x_ptrs, kt, BLOCK_K: gl.constexpr):
    """One K step's operands: code words, scale bytes and x runs."""
    words, scales = _load_weights(w_ptrs, s_ptrs, kt, BLOCK_K)
    return words, scales, gl.load(x_ptrs + kt * BLOCK_K)


@gluon.jit
def _weight_pointers(codes_ptr, scales_ptr, row0, N, stride_cn, stride_sn,
                     BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, WORDS: gl.constexpr, SCALES: gl.constexpr):
    """Pointers to the first K step's words ``[BN, 4, I]`` and scale bytes ``[BN, 4, I/2]`` of rows
    ``row0 ..`` (rows past N clamped: valid loads, dropped by the store mask)."""
    I: gl.constexpr = BLOCK_K // 32
    wr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, WORDS)))
    wt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WORDS)))
    wi = gl.arange(0, I, layout=gl.SliceLayout(0, gl.SliceLayout(1, WORDS)))
    w_rows = gl.minimum(row0 + wr, N - 1).to(gl.int64)
    w_ptrs = codes_ptr + (w_rows * stride_cn)[:, None, None] + (wt * I)[None, :, None] + wi[None, None, :]
    return w_ptrs, _scale_pointers(scales_ptr, row0, N, stride_sn, BLOCK_N, BLOCK_K, SCALES)


@gluon.jit
def _scale_pointers(scales_ptr, row0, N, stride_sn, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    SCALES: gl.constexpr):
    """Pointers to the first K step's scale bytes ``[BN, 4, I/2]`` of rows ``row0 ..`` (rows past N
    clamped), in :func:`scale_bytes_layout`."""
    I: gl.constexpr = BLOCK_K // 32
    sr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, SCALES)))
    st = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, SCALES)))
    si = gl.arange(0, I // 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, SCALES)))
    s_rows = gl.minimum(row0 + sr, N - 1).to(gl.int64)
    return scales_ptr + (s_rows * stride_sn)[:, None, None] + (st * (I // 2))[None, :, None] + si[None, None, :]


@gluon.jit
def _x_pointers(x_ptr, m0, m_end, stride_xm, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, XRUN: gl.constexpr):
    """Pointers to the first K step's x runs ``[4, 8 I, BM]`` of token rows ``m0 .. m0 + BM``; rows
    from ``m_end`` on read row ``m_end - 1`` again (L1 hits, no mask to zero registers for): their
    output columns depend on nothing else and are not stored."""
    I: gl.constexpr = BLOCK_K // 32
    xt = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, XRUN)))
    xj = gl.arange(0, 8 * I, layout=gl.SliceLayout(0, gl.SliceLayout(2, XRUN)))
    xm = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(1, XRUN)))
    rows = gl.minimum(xm, m_end - 1).to(gl.int64)
    return x_ptr + (rows * stride_xm)[None, None, :] + (xt * (8 * I))[:, None, None] + xj[None, :, None]


@gluon.jit
def _k_loop(acc, w_ptrs, s_ptrs, x_ptrs, kt_lo, kt_hi, BLOCK_K: gl.constexpr, PREFETCH: gl.constexpr,
            A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr, WORDS: gl.constexpr):
    """``acc += dq(W) @ x^T`` over K steps ``kt_lo .. kt_hi`` (at least one), the next ``PREFETCH``
    steps in flight (registers) while one is dequantized and multiplied; the last steps reload the
    final one (cache hits) instead of branching."""
    w0, s0, x0 = _load_step(w_ptrs, s_ptrs, x_ptrs, kt_lo, BLOCK_K)
    if PREFETCH == 1:
        for kt in range(kt_lo, kt_hi):
            w1, s1, x1 = _load_step(w_ptrs, s_ptrs, x_ptrs, gl.minimum(kt + 1, kt_hi - 1), BLOCK_K)
            acc = mma_v2(_dequant_a(w0, s0, A_LAYOUT, WORDS), _x_operand(x0, B_LAYOUT), acc)
            w0, s0, x0 = w1, s1, x1
    else:
        w1, s1, x1 = _load_step(w_ptrs, s_ptrs, x_ptrs, gl.minimum(kt_lo + 1, kt_hi - 1), BLOCK_K)
        for kt in range(kt_lo, kt_hi):
            w2, s2, x2 = _load_step(w_ptrs, s_ptrs, x_ptrs, gl.minimum(kt + 2, kt_hi - 1), BLOCK_K)
            acc = mma_v2(_dequant_a(w0, s0, A_LAYOUT, WORDS), _x_operand(x0, B_LAYOUT), acc)
            w0, s0, x0 = w1, s1, x1
            w1, s1, x1 = w2, s2, x2
    return acc


@gluon.constexpr_function
def x_slice_layout() -> gl.SwizzledSharedLayout:
    """One K step of :func:`_k_loop_x_slice`'s x in shared memory: ``[BM * I / 2, 64]`` bf16, 128-byte lines
    (a token row's ``BK`` values over ``I / 2`` lines) with each line's 16-byte chunks XOR-ed by the
    line index mod 8. The copy writes whole lines; the 8 lanes of a quarter warp reading
    :func:`x_slice_read_layout` (4 runs of 2 tokens) then land on 8 distinct chunk positions."""
    return gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])


@gluon.constexpr_function
def x_slice_read_layout(block_k: int, block_m: int, num_warps: int) -> gl.DistributedLinearLayout:
    """bf16 ``[BM * I / 2, 64]`` read from :func:`x_slice_layout`: the registers of
    :func:`x_run_layout`. Thread-in-quad ``t``'s value ``j = 8 c + v`` of token ``m`` is x's
    column ``8 p + v`` of the step (``p = I t + c``): line ``m I / 2 + p // 8``, column ``8 (p % 8) + v``."""
    i_words = block_k // 32

    def at(p: int) -> list[int]:  # p chunks further along a token's row: (lines, columns)
        return [p // 8, 8 * (p % 8)]

    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4]] + [at(c) for c in _bits(i_words)]
        + [[8 * b * (i_words // 2), 0] for b in _bits(block_m // 8)],
        lane_bases=[at(i_words), at(2 * i_words)] + [[b * (i_words // 2), 0] for b in (1, 2, 4)],
        warp_bases=[[0, 0]] * (num_warps.bit_length() - 1), block_bases=[], shape=[block_m * i_words // 2, 64],
    )


@gluon.constexpr_function
def x_slice_copy_layout(num_warps: int) -> gl.BlockedLayout:
    """bf16 ``[BM * I / 2, 64]`` for the copy into :func:`x_slice_layout`: 16 bytes a thread, whole
    128-byte lines (4 a warp instruction)."""
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[num_warps, 1],
                            order=[1, 0])


@gluon.jit
def _x_slice_pointers(x_ptr, m0, m_end, stride_xm, kt_lo, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                      NUM_WARPS: gl.constexpr):
    """Pointers to K step ``kt_lo``'s x (token rows ``m0 .. m0 + BM``) as :func:`x_slice_layout`'s
    lines, in :func:`x_slice_copy_layout`; rows from ``m_end`` on repeat row ``m_end - 1``."""
    COPY: gl.constexpr = x_slice_copy_layout(NUM_WARPS)
    line = gl.arange(0, BLOCK_M * BLOCK_K // 64, layout=gl.SliceLayout(1, COPY))
    col = gl.arange(0, 64, layout=gl.SliceLayout(0, COPY))
    rows = gl.minimum(m0 + line // (BLOCK_K // 64), m_end - 1).to(gl.int64)
    return x_ptr + (rows * stride_xm + (line % (BLOCK_K // 64)) * 64 + kt_lo * BLOCK_K)[:, None] + col[None, :]


@gluon.jit
def _x_slice_copy(x_smem, ptrs, kt_lo, kt_hi, FIRST: gl.constexpr, LAST: gl.constexpr, BLOCK_K: gl.constexpr):
    """Start copying K steps ``kt_lo + FIRST .. kt_lo + LAST`` (those before ``kt_hi``) of x into
    :func:`_k_loop_x_slice`'s buffer, as one commit group."""
    everywhere = gl.full(ptrs.shape, 0, gl.int32, layout=ptrs.type.layout) == 0
    for step in gl.static_range(FIRST, LAST):  # the buffer rounds the slice up to a power of 2: mask the rest
        async_copy.async_copy_global_to_shared(x_smem.index(step), ptrs + step * BLOCK_K,
                                               mask=everywhere & (kt_lo + step < kt_hi))
    async_copy.commit_group()


@gluon.jit
def _x_slice_ready(outstanding: gl.constexpr):
    """This thread's copies but the last ``outstanding`` groups have landed, and every warp's."""
    async_copy.wait_group(outstanding)
    gl.thread_barrier()


@gluon.jit
def _x_step_run(x_smem, step, XREAD: gl.constexpr, BLOCK_K: gl.constexpr):
    """One K step's x runs ``[4, 8 I, BM]`` read from :func:`_k_loop_x_slice`'s buffer (for :func:`_x_operand`)."""
    I: gl.constexpr = BLOCK_K // 32
    BLOCK_M: gl.constexpr = x_smem.shape[1] * 64 // BLOCK_K
    lines = x_smem.index(step).load(XREAD)  # [BM * I / 2, 64]: (m, p // 8) x (p % 8, v)
    v = gl.reshape(lines, (BLOCK_M, 4, I, 8))  # (m, t, c, v): p = I t + c
    return gl.reshape(gl.permute(v, (1, 2, 3, 0)), (4, 8 * I, BLOCK_M))


@gluon.jit
def _k_loop_x_slice(acc, w_ptrs, s_ptrs, x_ptr, m0, m_end, stride_xm, kt_lo, kt_hi,
                    BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, X_STEPS: gl.constexpr, NUM_WARPS: gl.constexpr,
                    PREFETCH: gl.constexpr, A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr, WORDS: gl.constexpr):
    """:func:`_k_loop` with x read from shared memory: the program copies its x slice (token rows
    ``m0 ..``, K steps ``kt_lo .. kt_hi``, at most ``X_STEPS``) there once and its warps share it;
    the weights stay ``PREFETCH`` steps ahead in registers. The first step's x is its own copy
    group, waited for before the loop (the first weights already in flight); the rest is waited for
    after the first step's MMA."""
    XREAD: gl.constexpr = x_slice_read_layout(BLOCK_K, BLOCK_M, NUM_WARPS)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [X_STEPS, BLOCK_M * BLOCK_K // 64, 64], x_slice_layout())
    x_ptrs = _x_slice_pointers(x_ptr, m0, m_end, stride_xm, kt_lo, BLOCK_M, BLOCK_K, NUM_WARPS)
    _x_slice_copy(x_smem, x_ptrs, kt_lo, kt_hi, 0, 1, BLOCK_K)
    w0, s0 = _load_weights(w_ptrs, s_ptrs, kt_lo, BLOCK_K)
    _x_slice_copy(x_smem, x_ptrs, kt_lo, kt_hi, 1, X_STEPS, BLOCK_K)
    if PREFETCH == 1:
        _x_slice_ready(1)
        for kt in range(kt_lo, kt_hi):
            w1, s1 = _load_weights(w_ptrs, s_ptrs, gl.minimum(kt + 1, kt_hi - 1), BLOCK_K)
            acc = _x_slice_step(acc, w0, s0, x_smem, kt, kt_lo, XREAD, BLOCK_K, A_LAYOUT, B_LAYOUT, WORDS)
            w0, s0 = w1, s1
    else:
        w1, s1 = _load_weights(w_ptrs, s_ptrs, gl.minimum(kt_lo + 1, kt_hi - 1), BLOCK_K)
        _x_slice_ready(1)
        for kt in range(kt_lo, kt_hi):
            w2, s2 = _load_weights(w_ptrs, s_ptrs, gl.minimum(kt + 2, kt_hi - 1), BLOCK_K)
            acc = _x_slice_step(acc, w0, s0, x_smem, kt, kt_lo, XREAD, BLOCK_K, A_LAYOUT, B_LAYOUT, WORDS)
            w0, s0 = w1, s1
            w1, s1 = w2, s2
    return acc


@gluon.jit
def _x_slice_step(acc, words, scales, x_smem, kt, kt_lo, XREAD: gl.constexpr, BLOCK_K: gl.constexpr,
                  A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr, WORDS: gl.constexpr):
    """One K step of :func:`_k_loop_x_slice`: ``acc += dq(words) @ x^T``, then, after the first
    step, wait for the rest of the slice (every warp, so the barrier stays uniform)."""
    run = _x_step_run(x_smem, kt - kt_lo, XREAD, BLOCK_K)
    acc = mma_v2(_dequant_a(words, scales, A_LAYOUT, WORDS), _x_operand(run, B_LAYOUT), acc)
    if kt == kt_lo:
        _x_slice_ready(0)
    return acc


@gluon.constexpr_function
def scale_copy_layout(block_n: int, block_k: int, num_warps: int) -> gl.BlockedLayout:
    """uint8 block scales ``[BN, BK/64, 4]`` for the asynchronous copy: 4 bytes (the smallest
    cp.async) per thread, a row's ``BK/16`` bytes over ``BK/64`` lanes."""
    lanes_k = block_k // 64
    return gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[32 // lanes_k, lanes_k, 1],
                            warps_per_cta=[num_warps, 1, 1], order=[2, 1, 0])


@gluon.jit
def _scale_copy_pointers(scales_ptr, row0, N, stride_sn, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         SCOPY: gl.constexpr):
    """Pointers to the first K step's scale bytes ``[BN, BK/64, 4]`` in :func:`scale_copy_layout`."""
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, SCOPY)))
    c = gl.arange(0, BLOCK_K // 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, SCOPY)))
    b = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, SCOPY)))
    rows = gl.minimum(row0 + r, N - 1).to(gl.int64)
    return scales_ptr + (rows * stride_sn)[:, None, None] + (c * 4)[None, :, None] + b[None, None, :]


@gluon.jit
def _issue_weights(words_smem, scales_smem, w_ptrs, s_ptrs, kt, kt_hi, BLOCK_K: gl.constexpr):
    """Start the copy of K step ``kt``'s words and scale bytes into one ring stage (zero bytes read
    past ``kt_hi``: the group still counts, so the waits below stay uniform)."""
    live = kt < kt_hi
    w_mask = gl.full(w_ptrs.shape, 0, gl.int32, layout=w_ptrs.type.layout) == 0
    s_mask = gl.full(s_ptrs.shape, 0, gl.int32, layout=s_ptrs.type.layout) == 0
    async_copy.async_copy_global_to_shared(words_smem, w_ptrs + kt * (BLOCK_K // 8), mask=w_mask & live)
    async_copy.async_copy_global_to_shared(scales_smem, s_ptrs + kt * (BLOCK_K // 16), mask=s_mask & live)
    async_copy.commit_group()


@gluon.jit
def _k_loop_staged(acc, words_ring, scales_ring, w_ptrs, s_ptrs, x_ptrs, kt_lo, kt_hi,
                   BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                   A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr, WORDS: gl.constexpr, SCALES: gl.constexpr):
    """:func:`_k_loop` with the weights through a ``STAGES``-deep shared-memory ring of cp.async
    copies (``STAGES - 1`` K steps in flight without holding registers); x one step ahead in
    registers as there. One barrier a step: the stage about to be refilled was read by every warp in
    the step before, and the stage about to be read was filled by every thread."""
    I: gl.constexpr = BLOCK_K // 32
    gl.thread_barrier()  # a previous loop over the ring (grouped kernel) is done reading it
    for j in gl.static_range(STAGES - 1):
        _issue_weights(words_ring.index(j), scales_ring.index(j), w_ptrs, s_ptrs, kt_lo + j, kt_hi, BLOCK_K)
    x0 = gl.load(x_ptrs + kt_lo * BLOCK_K)
    for kt in range(kt_lo, kt_hi):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        stage = (kt - kt_lo) % STAGES  # the ring starts at stage 0 whatever the slice's first step
        ahead = (stage + STAGES - 1) % STAGES
        _issue_weights(words_ring.index(ahead), scales_ring.index(ahead), w_ptrs, s_ptrs,
                       kt + STAGES - 1, kt_hi, BLOCK_K)
        x1 = gl.load(x_ptrs + gl.minimum(kt + 1, kt_hi - 1) * BLOCK_K)
        words = words_ring.index(stage).load(WORDS)
        scales = scales_ring.index(stage).reshape([words.shape[0], 4, I // 2]).load(SCALES)
        acc = mma_v2(_dequant_a(words, scales, A_LAYOUT, WORDS), _x_operand(x0, B_LAYOUT), acc)
        x0 = x1
    async_copy.wait_group(0)  # the zero-byte copies past kt_hi, before the ring is reused or freed
    return acc


@gluon.constexpr_function
def ring_layout(rank: int) -> gl.SwizzledSharedLayout:
    """The rings' shared layout, row-major and unswizzled: at ``BLOCK_K = 128`` a quad's 4 x 16-byte
    word runs of a row are 64 contiguous bytes and the 8 lanes of a quarter warp read 128 (no bank
    conflict)."""
    return gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=list(range(rank - 1, -1, -1)))


@gluon.jit
def _weight_ring(scales_ptr, row0, N, stride_sn, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 NUM_WARPS: gl.constexpr, STAGES: gl.constexpr):
    """The ``STAGES > 0`` path's shared-memory rings (words, scale bytes) and the scale copy's
    pointers (rows ``row0 ..``); the words are copied with :func:`_weight_pointers`' own pointers."""
    s_ptrs = _scale_copy_pointers(scales_ptr, row0, N, stride_sn, BLOCK_N, BLOCK_K,
                                  scale_copy_layout(BLOCK_N, BLOCK_K, NUM_WARPS))
    words_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 4, BLOCK_K // 32], ring_layout(3))
    scales_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_K // 64, 4], ring_layout(3))
    return s_ptrs, words_ring, scales_ring


@gluon.jit
def _store_tile(acc, y_ptr, partials_ptr, counters_ptr, ws2_ptr, pid_n, pid_k, pid_m, M, N, stride_ym,
                BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, SPLIT_K: gl.constexpr, MMA: gl.constexpr):
    """Store this program's ``y^T [BLOCK_N, BLOCK_M]`` tile (times ``weight_scale_2``), or with
    split-K its partial, the last program of the tile to arrive summing all of them in a fixed order."""
    on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    y_ptrs = y_ptr + om[None, :].to(gl.int64) * stride_ym + on[:, None]
    y_mask = (on < N)[:, None] & (om < M)[None, :]
    decode = gl.load(ws2_ptr) * (2.0 ** -OPERAND_LOG2_SCALE)
    if SPLIT_K == 1:
        gl.store(y_ptrs, (acc * decode).to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tile = pid_m * gl.num_programs(0) + pid_n
        TILE: gl.constexpr = BLOCK_N * BLOCK_M
        local = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))[:, None] * BLOCK_M + \
            gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))[None, :]
        base = partials_ptr + tile.to(gl.int64) * (SPLIT_K * TILE)
        gl.store(base + pid_k * TILE + local, acc)
        gl.thread_barrier()  # every thread's partial is stored before the release below
        arrived = gl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=MMA)
            for s in gl.static_range(SPLIT_K):  # fixed order: the result does not depend on timing
                total += gl.load(base + s * TILE + local, cache_modifier=".cg")
            gl.store(y_ptrs, (total * decode).to(y_ptr.dtype.element_ty), mask=y_mask)
            gl.atomic_xchg(counters_ptr + tile, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _split_steps(K, pid_k, BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr):
    """K steps ``[kt_lo, kt_hi)`` of split ``pid_k`` (empty for a split past the last step)."""
    k_tiles = K // BLOCK_K
    per_split = gl.cdiv(k_tiles, SPLIT_K)
    kt_lo = pid_k * per_split
    return kt_lo, gl.minimum(kt_lo + per_split, k_tiles)


@gluon.jit
def _decode_kernel(
    x_ptr, codes_ptr, scales_ptr, ws2_ptr, y_ptr, partials_ptr, counters_ptr,
    M, N, K, stride_xm, stride_cn, stride_sn, stride_ym,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr,
    NUM_WARPS: gl.constexpr, PREFETCH: gl.constexpr, STAGES: gl.constexpr, X_STEPS: gl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))``: one K slice of one ``y^T [BLOCK_N, BLOCK_M]`` tile."""
    MMA: gl.constexpr = mma_layout(NUM_WARPS)
    A_LAYOUT: gl.constexpr = operand_layout(0, NUM_WARPS)
    B_LAYOUT: gl.constexpr = operand_layout(1, NUM_WARPS)
    WORDS: gl.constexpr = words_layout(BLOCK_N, BLOCK_K, NUM_WARPS)
    SCALES: gl.constexpr = scale_bytes_layout(BLOCK_N, BLOCK_K, NUM_WARPS)
    XRUN: gl.constexpr = x_run_layout(BLOCK_K, BLOCK_M, NUM_WARPS)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    kt_lo, kt_hi = _split_steps(K, pid_k, BLOCK_K, SPLIT_K)

    x_ptrs = _x_pointers(x_ptr, pid_m * BLOCK_M, M, stride_xm, BLOCK_M, BLOCK_K, XRUN)
    w_ptrs, s_ptrs = _weight_pointers(codes_ptr, scales_ptr, pid_n * BLOCK_N, N, stride_cn, stride_sn,
                                      BLOCK_N, BLOCK_K, WORDS, SCALES)
    acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=MMA)
    if X_STEPS > 0:
        if kt_lo < kt_hi:  # uniform over the program: its barriers are reached by every warp or none
            acc = _k_loop_x_slice(acc, w_ptrs, s_ptrs, x_ptr, pid_m * BLOCK_M, M, stride_xm, kt_lo, kt_hi, BLOCK_M,
                                  BLOCK_K, X_STEPS, NUM_WARPS, PREFETCH, A_LAYOUT, B_LAYOUT, WORDS)
    elif STAGES == 0:
        if kt_lo < kt_hi:  # a split past the last K step (SPLIT_K not dividing the steps) adds nothing
            acc = _k_loop(acc, w_ptrs, s_ptrs, x_ptrs, kt_lo, kt_hi, BLOCK_K, PREFETCH, A_LAYOUT, B_LAYOUT, WORDS)
    else:
        s_ptrs, words_ring, scales_ring = _weight_ring(scales_ptr, pid_n * BLOCK_N, N, stride_sn, BLOCK_N, BLOCK_K,
                                                       NUM_WARPS, STAGES)
        if kt_lo < kt_hi:
            acc = _k_loop_staged(acc, words_ring, scales_ring, w_ptrs, s_ptrs, x_ptrs, kt_lo, kt_hi, BLOCK_K, STAGES,
                                 A_LAYOUT, B_LAYOUT, WORDS, SCALES)

    _store_tile(acc, y_ptr, partials_ptr, counters_ptr, ws2_ptr, pid_n, pid_k, pid_m, M, N, stride_ym,
                BLOCK_N, BLOCK_M, SPLIT_K, MMA)


@gluon.jit
def _grouped_decode_kernel(
    x_ptr, codes_ptr, scales_ptr, ws2_ptr, offsets_ptr, y_ptr,
    N, K, stride_xm, stride_ce, stride_cn, stride_se, stride_sn, stride_w2, stride_ym,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    NUM_WARPS: gl.constexpr, PREFETCH: gl.constexpr, STAGES: gl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), E)``: expert ``e``'s rows ``offsets[e]:offsets[e+1]`` in chunks of
    ``BLOCK_M`` tokens, one N tile, the whole K (no split: the experts give the parallelism)."""
    MMA: gl.constexpr = mma_layout(NUM_WARPS)
    A_LAYOUT: gl.constexpr = operand_layout(0, NUM_WARPS)
    B_LAYOUT: gl.constexpr = operand_layout(1, NUM_WARPS)
    WORDS: gl.constexpr = words_layout(BLOCK_N, BLOCK_K, NUM_WARPS)
    SCALES: gl.constexpr = scale_bytes_layout(BLOCK_N, BLOCK_K, NUM_WARPS)
    XRUN: gl.constexpr = x_run_layout(BLOCK_K, BLOCK_M, NUM_WARPS)

    pid_n = gl.program_id(0)
    expert = gl.program_id(1)
    lo = gl.load(offsets_ptr + expert)
    hi = gl.load(offsets_ptr + expert + 1)
    e64 = expert.to(gl.int64)
    w_ptrs, s_ptrs = _weight_pointers(codes_ptr + e64 * stride_ce, scales_ptr + e64 * stride_se, pid_n * BLOCK_N, N,
                                      stride_cn, stride_sn, BLOCK_N, BLOCK_K, WORDS, SCALES)
    if STAGES > 0:
        s_ptrs, words_ring, scales_ring = _weight_ring(scales_ptr + e64 * stride_se, pid_n * BLOCK_N, N, stride_sn,
                                                       BLOCK_N, BLOCK_K, NUM_WARPS, STAGES)
    decode = gl.load(ws2_ptr + expert * stride_w2) * (2.0 ** -OPERAND_LOG2_SCALE)
    on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    for m0 in range(lo, hi, BLOCK_M):  # no iteration for an expert without rows
        x_ptrs = _x_pointers(x_ptr, m0, hi, stride_xm, BLOCK_M, BLOCK_K, XRUN)
        acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=MMA)
        if STAGES == 0:
            acc = _k_loop(acc, w_ptrs, s_ptrs, x_ptrs, 0, K // BLOCK_K, BLOCK_K, PREFETCH, A_LAYOUT, B_LAYOUT, WORDS)
        else:
            acc = _k_loop_staged(acc, words_ring, scales_ring, w_ptrs, s_ptrs, x_ptrs, 0, K // BLOCK_K, BLOCK_K, STAGES,
                                 A_LAYOUT, B_LAYOUT, WORDS, SCALES)
        om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
        y_ptrs = y_ptr + om[None, :].to(gl.int64) * stride_ym + on[:, None]
        gl.store(y_ptrs, (acc * decode).to(y_ptr.dtype.element_ty), mask=(on < N)[:, None] & (om < hi)[None, :])


DEFAULT_CONFIG = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 2, "PREFETCH": 1, "STAGES": 0, "X_SMEM": 0}


def _launch_options(cfg: dict[str, Any]) -> dict[str, int]:
    """``maxnreg`` when the config sets it: ptxas caps 1-warp CTAs at 168 registers and spills some
    of these configs (offline sm_90: 16x64x64 with 2-step prefetch spills at 168, fits 244 at 255)."""
    return {"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}


def _check_config(cfg: dict[str, Any], k: int) -> None:
    """Raise unless ``cfg`` tiles a K of ``k`` the way the kernels need (``SPLIT_K`` only if present)."""
    block_n, block_k, warps = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    if k % block_k or block_k % 64 or block_n % (16 * warps):
        raise ValueError(f"need K % BLOCK_K == 0, BLOCK_K % 64 == 0 and BLOCK_N % (16 * num_warps) == 0, got "
                         f"K={k}, {cfg}")
    if cfg["PREFETCH"] not in (1, 2) or cfg.get("SPLIT_K", 1) < 1 or cfg["BLOCK_M"] not in (8, 16, 32):
        raise ValueError(f"PREFETCH must be 1 or 2, SPLIT_K at least 1 and BLOCK_M 8, 16 or 32, got {cfg}")
    stages = cfg["STAGES"]
    if stages not in (0, *range(2, 9)) or (stages and block_n * block_k // 64 < 32 * warps):
        raise ValueError(f"STAGES must be 0 (registers) or 2..8, and with stages BLOCK_N * BLOCK_K / 64 at least "
                         f"32 * num_warps (the scale copy's threads), got {cfg}")
    if cfg.get("X_SMEM", 0) not in (0, 1) or (cfg.get("X_SMEM", 0) and stages):
        raise ValueError(f"X_SMEM must be 0 or 1, and 1 only with STAGES = 0, got {cfg}")


X_SLICE_MAX_BYTES = 160 * 1024
"""Shared memory the ``X_SMEM`` path may take for its x slice (the H100/H200 give a CTA up to 227 KiB;
at most a third of an SM keeps several CTAs resident)."""


def x_slice_steps(k_tiles: int, split_k: int) -> int:
    """K steps of x a program of the ``X_SMEM`` path holds: its slice's, rounded up to a power of 2
    (a tensor shape)."""
    return triton.next_power_of_2(triton.cdiv(k_tiles, split_k))


def default_block_m(tokens: int) -> int:
    """Tokens per tile: the smallest of 8, 16, 32 that holds ``tokens`` (x's registers grow with it:
    394 / 463 / 526 instructions per 64 x 128 K step in the offline sm_90 compile)."""
    return 8 if tokens <= 8 else 16 if tokens <= 16 else 32


def dense_call(x: torch.Tensor, weight: NVFP4Tensor, out: torch.Tensor, default: dict[str, int],
               config: dict[str, int] | None) -> tuple[dict[str, Any], int, int, int]:
    """Check a dense decode call's operands (x ``[M, K]``, ``out`` bf16 ``[M, N]``) and merge ``config``
    over ``default`` (``BLOCK_M`` from :func:`default_block_m`): ``(config, M, N, K)``."""
    n, k = weight.shape
    cfg: dict[str, Any] = {**default, "BLOCK_M": default_block_m(x.shape[0]), **(config or {})}
    _check_weight_parts(x, weight, k)
    if x.ndim != 2:
        raise ValueError(f"x must be [M, {k}], got shape {tuple(x.shape)}")
    m = x.shape[0]
    _check_out(out, (m, n), (torch.bfloat16,), x.device)
    return cfg, m, n, k


def w4a16_mma_linear_into(x: torch.Tensor, weight: NVFP4Tensor, out: torch.Tensor,
                          config: dict[str, int] | None = None) -> torch.Tensor:
    """``out [M, N] = x [M, K] @ dq(W).T`` (bf16) with :func:`_decode_kernel`.

    ``config`` (default :data:`DEFAULT_CONFIG`) holds ``BLOCK_M`` (tokens per tile: 8, 16 or 32;
    default :func:`default_block_m`), ``BLOCK_N`` (a multiple of ``16 * num_warps``), ``BLOCK_K``
    (a multiple of 64 dividing K), ``SPLIT_K``, ``num_warps``, ``PREFETCH`` (K steps loaded ahead
    into registers: 1 or 2), ``STAGES`` (0: weights loaded into registers as x; 2..8: through a ring
    of that many shared-memory stages, :func:`_k_loop_staged`, x then one step ahead whatever
    ``PREFETCH``), ``X_SMEM`` (1: each program copies its x slice into shared memory once and its
    warps read their B fragments from there, :func:`_k_loop_x_slice`; 0: every warp loads x from global
    memory each step) and optionally ``maxnreg``.
    """
    cfg, m, n, k = dense_call(x, weight, out, DEFAULT_CONFIG, config)
    _check_config(cfg, k)
    block_n, block_k, split_k, warps = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"], cfg["num_warps"]
    if m == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    codes, scales = _operands(weight)
    ws2 = weight.weight_scale_2.reshape(1).to(torch.float32)
    block_m = cfg["BLOCK_M"]
    n_tiles, m_tiles = triton.cdiv(n, block_n), triton.cdiv(m, block_m)
    partials = _triton_w4a16._new_partials(  # looked up there: the tests poison it in one place
        split_k * n_tiles * block_n * m_tiles * block_m if split_k > 1 else 1, x.device)
    counters = _split_counters(x.device, n_tiles * m_tiles)
    x_steps = x_slice_steps(k // block_k, split_k) if cfg["X_SMEM"] else 0
    if x_steps * block_k * block_m * 2 > X_SLICE_MAX_BYTES:
        raise ValueError(f"X_SMEM: the x slice of {x_steps} K steps x {block_k} x {block_m} tokens needs "
                         f"{x_steps * block_k * block_m * 2} bytes of shared memory, more than {X_SLICE_MAX_BYTES}; "
                         "raise SPLIT_K or lower BLOCK_M")
    _decode_kernel[(n_tiles, split_k, m_tiles)](
        x, codes, scales, ws2, out, partials, counters,
        m, n, k, x.stride(0), codes.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, NUM_WARPS=warps, PREFETCH=cfg["PREFETCH"],
        STAGES=cfg["STAGES"], X_STEPS=x_steps, num_warps=warps,
        **_launch_options(cfg),
    )
    return out


GROUPED_DEFAULT_CONFIG = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 2, "PREFETCH": 1, "STAGES": 0}


def grouped_w4a16_mma_into(x: torch.Tensor, weight: NVFP4Tensor, expert_offsets: torch.Tensor, out: torch.Tensor,
                           config: dict[str, int] | None = None) -> torch.Tensor:
    """Grouped MoE W4A16 with :func:`_grouped_decode_kernel`: ``out[rows of e] = x[rows of e] @ dq(W_e).T``.

    ``x [T, K]`` bf16 sorted by expert, ``weight`` stacked ``[E, N, K]`` (``weight_scale_2`` one
    value or one per expert), ``expert_offsets`` int32 ``[E + 1]`` on x's device (not checked on the
    host: no sync). ``config`` as in :func:`w4a16_mma_linear_into` without ``SPLIT_K``; the default
    token tile follows the mean rows per expert.
    """
    num_experts, n, k = check_grouped_bf16_call(x, weight, expert_offsets, out)
    mean_rows = triton.cdiv(2 * x.shape[0], max(num_experts, 1))  # twice the mean: most experts fit one tile
    cfg: dict[str, Any] = {**GROUPED_DEFAULT_CONFIG, "BLOCK_M": default_block_m(mean_rows), **(config or {})}
    _check_config(cfg, k)
    if cfg.get("X_SMEM"):
        raise ValueError("X_SMEM is a path of the dense kernel only (grouped programs walk several token tiles)")
    block_m, block_n, block_k, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    if out.numel() == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    codes, scales = _operands(weight)
    ws2 = weight.weight_scale_2.reshape(-1).to(torch.float32)
    _grouped_decode_kernel[(triton.cdiv(n, block_n), num_experts)](
        x, codes, scales, ws2, expert_offsets, out,
        n, k, x.stride(0), codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1),
        1 if ws2.numel() > 1 else 0, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_WARPS=warps, PREFETCH=cfg["PREFETCH"], STAGES=cfg["STAGES"],
        num_warps=warps,
        **_launch_options(cfg),
    )
    return out
