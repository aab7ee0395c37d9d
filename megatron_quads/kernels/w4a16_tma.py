"""Experimental decode W4A16 kernel in Gluon: the weights' code words streamed by TMA.

Branch ``tma-ring`` only: compiled offline for sm_90 (Triton 3.6), never run on a GPU yet. It is
the design docs/kernels.md arrives at after the session-8 measurements of
:mod:`megatron_quads.kernels.w4a16_mma`: there each warp loads its next K step's weights into
registers, so the prefetch depth is bounded by registers (one step) and each warp's chain of
load -> dequantize -> MMA is what the time goes to (~2 warps a scheduler, issue ~47%, DRAM ~37%
of peak, and neither more warps nor dropping the dequantization reached the target).

Here the code words of the next ``STAGES`` K steps are in flight as TMA copies into a shared-memory
ring (no registers, no load instructions but one per stage), each stage with its own mbarrier that
the copy completes; the warps wait on that barrier, read the stage into the same registers as the
register path (:func:`~megatron_quads.kernels.w4a16_mma.words_layout`, 16-byte
``LDS``), and the stage is refilled with step ``kt + STAGES`` as soon as every warp has read it.
The scale bytes (1/8 of the bytes) stay one step ahead in registers; x comes through the ring
beside the words (``X_RING``, one more TMA copy a stage) or is copied into shared memory once a
program (the ``X_SMEM`` path's slice, shared by its warps). Split-K, the dequantization, the MMA and the epilogue
are the register path's.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megatron_quads.kernels import w4a16 as _triton_w4a16
from megatron_quads.kernels.w4a16 import (
    _operands,
    _split_counters,
)
from megatron_quads.kernels.w4a16_mma import (
    X_SLICE_MAX_BYTES,
    _bits,
    _dequant_a,
    _row_bases,
    _scale_pointers,
    _split_steps,
    _store_tile,
    _x_operand,
    _x_slice_copy,
    _x_slice_pointers,
    _x_slice_ready,
    _x_step_run,
    dense_call,
    mma_layout,
    operand_layout,
    scale_bytes_layout,
    words_layout,
    x_slice_layout,
    x_slice_read_layout,
    x_slice_steps,
)
from megatron_quads.nvfp4.tensor import NVFP4Tensor


@gluon.constexpr_function
def words_tile_layout(block_n: int, block_k: int, num_warps: int) -> gl.DistributedLinearLayout:
    """int32 code words ``[BN, BK / 8]`` of one ring stage as :func:`words_layout` holds them
    (thread ``t`` of a quad: words ``I t .. I t + I - 1`` of its rows), before the reshape to
    ``[BN, 4, I]``."""
    i_words = block_k // 32
    lanes, regs, warps = _row_bases(block_n, num_warps, 2)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, b] for b in _bits(i_words)] + regs, lane_bases=[[0, i_words], [0, 2 * i_words]] + lanes,
        warp_bases=warps, block_bases=[], shape=[block_n, block_k // 8],
    )


@gluon.constexpr_function
def words_ring_layout() -> gl.NVMMASharedLayout:
    """The ring's shared layout (also the TMA descriptor's): unswizzled rows of ``BK / 2`` bytes; at
    ``BK = 128`` the 8 lanes of a quarter warp read 4 x 16 bytes of two consecutive rows, 128
    contiguous bytes (no bank conflict)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@gluon.constexpr_function
def x_ring_layout() -> gl.NVMMASharedLayout:
    """The x ring's shared layout (and its TMA descriptor's): a stage is ``[BM, BK / 64, 64]`` bf16,
    128-byte lines (line ``m BK / 64 + h``) with the 16-byte chunks XOR-ed by the line mod 8 (TMA's
    128-byte swizzle): the layout of :func:`~megatron_quads.kernels.w4a16_mma.x_slice_layout`,
    so :func:`x_ring_read_layout`'s quarter warps read 8 distinct chunk positions."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)


@gluon.constexpr_function
def x_ring_read_layout(block_k: int, block_m: int, num_warps: int) -> gl.DistributedLinearLayout:
    """bf16 ``[BM, BK / 64, 64]`` of one x ring stage in the registers of
    :func:`~megatron_quads.kernels.w4a16_mma.x_run_layout`: thread-in-quad ``t``'s value
    ``j = 8 c + v`` of token ``m`` is the step's column ``8 p + v`` (``p = I t + c``): ``[m, p // 8,
    8 (p % 8) + v]``."""
    i_words = block_k // 32

    def at(p: int) -> list[int]:  # p chunks further along a token's row
        return [0, p // 8, 8 * (p % 8)]

    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4]] + [at(c) for c in _bits(i_words)]
        + [[8 * b, 0, 0] for b in _bits(block_m // 8)],
        lane_bases=[at(i_words), at(2 * i_words), [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[0, 0, 0]] * (num_warps.bit_length() - 1), block_bases=[], shape=[block_m, block_k // 64, 64],
    )


@gluon.jit
def _x_ring_run(x_stage, XR: gl.constexpr, BLOCK_K: gl.constexpr):
    """One x ring stage ``[BM, BK / 64, 64]`` as the runs ``[4, 8 I, BM]`` of :func:`_x_operand`."""
    I: gl.constexpr = BLOCK_K // 32
    BLOCK_M: gl.constexpr = x_stage.shape[0]
    v = gl.reshape(x_stage.load(XR), (BLOCK_M, 4, I, 8))  # (m, p // 8, p % 8, v) -> (m, t, c, v): p = I t + c
    return gl.reshape(gl.permute(v, (1, 2, 3, 0)), (4, 8 * I, BLOCK_M))


@gluon.jit
def _issue_stage(w_desc, x_desc, ring, x_ring, full, stage, row0, m0, kt,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, X_RING: gl.constexpr):
    """Start the TMA copies of K step ``kt``'s code words (rows ``row0 ..``) and, with ``X_RING``,
    its x (token rows ``m0 ..``) into ring ``stage``; ``full[stage]`` completes when both land.
    Rows past N or M read as zeros (their outputs are not stored)."""
    x_bytes: gl.constexpr = BLOCK_M * BLOCK_K * 2 if X_RING else 0
    mbarrier.expect(full.index(stage), BLOCK_N * BLOCK_K // 2 + x_bytes)
    tma.async_copy_global_to_shared(w_desc, [row0, kt * (BLOCK_K // 8)], full.index(stage), ring.index(stage))
    if X_RING:
        tma.async_copy_global_to_shared(x_desc, [m0, kt * (BLOCK_K // 64), 0], full.index(stage), x_ring.index(stage))


@gluon.jit
def _k_loop_tma(acc, w_desc, x_desc, s_ptrs, row0, x_ptr, m0, m_end, stride_xm, kt_lo, kt_hi,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, X_STEPS: gl.constexpr,
                STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr, WORDS: gl.constexpr):
    """``acc += dq(W) @ x^T`` over K steps ``kt_lo .. kt_hi`` (at least one): code words through the
    TMA ring, scale bytes one step ahead in registers, x from the program's shared slice
    (``X_STEPS > 0``) or through the ring beside the words (``X_STEPS == 0``)."""
    I: gl.constexpr = BLOCK_K // 32
    X_RING: gl.constexpr = X_STEPS == 0
    WTILE: gl.constexpr = words_tile_layout(BLOCK_N, BLOCK_K, NUM_WARPS)
    ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], words_ring_layout())
    if X_RING:
        x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K // 64, 64], x_ring_layout())
    else:
        x_ring = ring  # not read: the copies of _issue_stage skip x
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(full.index(j), count=1)
    fence_async_shared()  # the initialized barriers are visible to the TMA unit
    gl.thread_barrier()
    for j in gl.static_range(STAGES):
        if kt_lo + j < kt_hi:
            _issue_stage(w_desc, x_desc, ring, x_ring, full, j, row0, m0, kt_lo + j, BLOCK_M, BLOCK_N, BLOCK_K, X_RING)

    XREAD: gl.constexpr = x_slice_read_layout(BLOCK_K, BLOCK_M, NUM_WARPS)
    XR: gl.constexpr = x_ring_read_layout(BLOCK_K, BLOCK_M, NUM_WARPS)
    if X_RING:
        s0 = gl.load(s_ptrs + kt_lo * (BLOCK_K // 16))
        x_smem = ring  # not read
    else:
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [X_STEPS, BLOCK_M * BLOCK_K // 64, 64], x_slice_layout())
        x_ptrs = _x_slice_pointers(x_ptr, m0, m_end, stride_xm, kt_lo, BLOCK_M, BLOCK_K, NUM_WARPS)
        _x_slice_copy(x_smem, x_ptrs, kt_lo, kt_hi, 0, X_STEPS, BLOCK_K)
        s0 = gl.load(s_ptrs + kt_lo * (BLOCK_K // 16))
        _x_slice_ready(0)

    for kt in range(kt_lo, kt_hi):
        i = kt - kt_lo
        stage = i % STAGES
        mbarrier.wait(full.index(stage), (i // STAGES) & 1)
        words = gl.convert_layout(gl.reshape(ring.index(stage).load(WTILE), (BLOCK_N, 4, I)), WORDS,
                                  assert_trivial=True)
        if X_RING:
            run = _x_ring_run(x_ring.index(stage), XR, BLOCK_K)
        else:
            run = _x_step_run(x_smem, i, XREAD, BLOCK_K)
        s1 = gl.load(s_ptrs + gl.minimum(kt + 1, kt_hi - 1) * (BLOCK_K // 16))
        # every thread's reads of the stage are performed before the copy that refills it is issued
        # (bar.sync orders them for the CTA, the proxy fence against the TMA's async-proxy writes)
        gl.thread_barrier()
        if kt + STAGES < kt_hi:
            fence_async_shared()
            _issue_stage(w_desc, x_desc, ring, x_ring, full, stage, row0, m0, kt + STAGES, BLOCK_M, BLOCK_N, BLOCK_K,
                         X_RING)
        acc = mma_v2(_dequant_a(words, s0, A_LAYOUT, WORDS), _x_operand(run, B_LAYOUT), acc)
        s0 = s1
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(j))
    return acc


@gluon.jit
def _decode_kernel_tma(
    x_ptr, w_desc, x_desc, scales_ptr, ws2_ptr, y_ptr, partials_ptr, counters_ptr,
    M, N, K, stride_xm, stride_sn, stride_ym,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr,
    NUM_WARPS: gl.constexpr, STAGES: gl.constexpr, X_STEPS: gl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))``: one K slice of one ``y^T [BLOCK_N, BLOCK_M]`` tile."""
    MMA: gl.constexpr = mma_layout(NUM_WARPS)
    A_LAYOUT: gl.constexpr = operand_layout(0, NUM_WARPS)
    B_LAYOUT: gl.constexpr = operand_layout(1, NUM_WARPS)
    WORDS: gl.constexpr = words_layout(BLOCK_N, BLOCK_K, NUM_WARPS)
    SCALES: gl.constexpr = scale_bytes_layout(BLOCK_N, BLOCK_K, NUM_WARPS)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    kt_lo, kt_hi = _split_steps(K, pid_k, BLOCK_K, SPLIT_K)
    s_ptrs = _scale_pointers(scales_ptr, pid_n * BLOCK_N, N, stride_sn, BLOCK_N, BLOCK_K, SCALES)
    acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=MMA)
    if kt_lo < kt_hi:  # uniform over the program: its barriers are reached by every warp or none
        acc = _k_loop_tma(acc, w_desc, x_desc, s_ptrs, pid_n * BLOCK_N, x_ptr, pid_m * BLOCK_M, M, stride_xm, kt_lo, kt_hi,
                          BLOCK_M, BLOCK_N, BLOCK_K, X_STEPS, STAGES, NUM_WARPS, A_LAYOUT, B_LAYOUT, WORDS)
    _store_tile(acc, y_ptr, partials_ptr, counters_ptr, ws2_ptr, pid_n, pid_k, pid_m, M, N, stride_ym,
                BLOCK_N, BLOCK_M, SPLIT_K, MMA)


DEFAULT_CONFIG = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8, "num_warps": 1, "STAGES": 4, "X_RING": 1, "maxnreg": 255}


def _check_config(cfg: dict[str, Any], k: int, x_steps: int) -> None:
    """Raise unless ``cfg`` tiles a K of ``k`` the way :func:`_decode_kernel_tma` needs and its
    shared memory (the ring, with x in it or an x slice of ``x_steps`` K steps beside it) fits."""
    block_m, block_n, block_k, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    if k % block_k or block_k % 64 or block_n % (16 * warps) or block_n > 256 or block_m not in (8, 16, 32):
        raise ValueError(f"need K % BLOCK_K == 0, BLOCK_K % 64 == 0, BLOCK_N % (16 * num_warps) == 0, BLOCK_N <= 256 "
                         f"(a TMA box) and BLOCK_M 8, 16 or 32, got K={k}, {cfg}")
    if cfg["STAGES"] not in range(2, 9) or cfg["SPLIT_K"] < 1 or cfg["X_RING"] not in (0, 1):
        raise ValueError(f"STAGES must be 2..8, SPLIT_K at least 1 and X_RING 0 or 1, got {cfg}")
    stage = block_n * block_k // 2 + (block_m * block_k * 2 if cfg["X_RING"] else 0)
    x_slice = x_steps * block_k * block_m * 2
    if x_slice > X_SLICE_MAX_BYTES or cfg["STAGES"] * stage + x_slice > 200 * 1024:
        raise ValueError(f"the ring ({cfg['STAGES']} stages of {stage} bytes) and the x slice ({x_slice} bytes) do not "
                         "fit in shared memory; raise SPLIT_K, or lower STAGES, BLOCK_N or BLOCK_M")


def w4a16_tma_linear_into(x: torch.Tensor, weight: NVFP4Tensor, out: torch.Tensor,
                          config: dict[str, int] | None = None) -> torch.Tensor:
    """``out [M, N] = x [M, K] @ dq(W).T`` (bf16) with :func:`_decode_kernel_tma`.

    ``config`` (default :data:`DEFAULT_CONFIG`) holds ``BLOCK_M`` (8, 16 or 32; default
    :func:`~megatron_quads.kernels.w4a16_mma.default_block_m`), ``BLOCK_N`` (a multiple of
    ``16 * num_warps``, at most 256), ``BLOCK_K`` (a multiple of 64 dividing K), ``SPLIT_K``,
    ``num_warps``, ``STAGES`` (ring depth, 2..8), ``X_RING`` (1: x through the ring beside the
    words, one TMA copy a stage; 0: the program's x slice copied into shared memory once, shared
    by its warps) and optionally ``maxnreg``.
    """
    cfg, m, n, k = dense_call(x, weight, out, DEFAULT_CONFIG, config)
    block_m, block_n, block_k, split_k, warps = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"],
                                                 cfg["num_warps"])
    x_steps = x_slice_steps(k // block_k, split_k) if k % block_k == 0 and not cfg["X_RING"] else 0
    _check_config(cfg, k, x_steps)
    if m == 0:
        return out
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # TMA: 16-byte aligned rows
        x = x.contiguous()
    codes, scales = _operands(weight)
    w_desc = TensorDescriptor(codes, list(codes.shape), [codes.stride(0), 1], [block_n, block_k // 8],
                              words_ring_layout())
    # x as [M, K / 64, 64]: a box is one K step of BM tokens in 128-byte lines (not read without X_RING)
    x_desc = TensorDescriptor(x, [m, k // 64, 64], [x.stride(0), 64, 1], [block_m, block_k // 64, 64],
                              x_ring_layout()) if cfg["X_RING"] else w_desc
    ws2 = weight.weight_scale_2.reshape(1).to(torch.float32)
    n_tiles, m_tiles = triton.cdiv(n, block_n), triton.cdiv(m, block_m)
    partials = _triton_w4a16._new_partials(
        split_k * n_tiles * block_n * m_tiles * block_m if split_k > 1 else 1, x.device)
    counters = _split_counters(x.device, n_tiles * m_tiles)
    _decode_kernel_tma[(n_tiles, split_k, m_tiles)](
        x, w_desc, x_desc, scales, ws2, out, partials, counters,
        m, n, k, x.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, NUM_WARPS=warps, STAGES=cfg["STAGES"],
        X_STEPS=x_steps, num_warps=warps,
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    return out
