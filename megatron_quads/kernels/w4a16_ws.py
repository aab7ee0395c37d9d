"""Grouped (MoE) W4A16 in Gluon with warp specialization: a loader warp streams, the MMA warps compute.

The Triton grouped kernel (:func:`~megatron_quads.kernels.w4a16.grouped_w4a16_into`) issues its
loads, the dequantization and the wgmma from the same warps, which then wait on their own pipeline
(its profile is in docs/kernels.md). Here the work is split the way Hopper GEMMs are
(``gl.warp_specialize``):

* persistent programs (``CTAS_PER_SM`` an SM) take the ``E * N / BN`` (expert, N tile) pairs
  ``p, p + P, ...`` expert-major, or (``DYNAMIC``, the default up to K 1024) pair ``p`` and then the
  next one a shared counter hands out, each over its expert's rows in token tiles of ``BM`` (a
  half-width tile for the last ``BM / 2`` rows or fewer, as the Triton kernel does);
* one loader warp (:func:`_load_partition`) walks them and puts each K step's code words
  ``[BN, BK/8]`` (int32), at ``BLOCK_K`` 256 their scale bytes ``[BN, BK/16]`` (``SCALE_RING``), and
  x (bf16, already in the MMA K order of :func:`~megatron_quads.kernels.w4a16.mma_k_order_rows`;
  ``BK / 64`` tiles of ``[BM, 64]`` by half-height boxes) into a ring of ``STAGES`` shared-memory
  stages by TMA, each stage completing a ``ready`` mbarrier;
* the MMA warps (the default partition, ``BN / 64`` warpgroups, :func:`_mma_partition`; with
  ``WG_SPLIT`` each of the two warpgroups its own partition on its rows of the stage) wait on it,
  read a 128-wide sub-step's words into the registers of the wgmma A operand (the K permutation of
  :func:`_dequant_a`: no data moves between threads),
  dequantize them and issue register-A wgmma against the x tiles in shared memory; the next
  sub-step's words are read while they run, and a stage goes back to the loader (its ``empty``
  mbarrier) once the wgmma that read it have retired. At ``BLOCK_K`` 128 (K not a multiple of 256)
  the MMA warps load the scale bytes (1/9 of the weight bytes) themselves, one sub-step ahead.

Same operands, products and K order of the fp32 accumulation as the Triton kernel, so the same bits
(GPU-tested). Which calls run here is :mod:`~megatron_quads.kernels.dispatch`'s rule (sm_90, x in
K order); ``benchmarks/bench_kernels.py --only grouped_ws`` times its configs against the Triton
kernel and BF16 ``grouped_mm``. Needs ``K % BLOCK_K == 0`` and x in the K order of 128-blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megatron_quads.kernels.dispatch import X_ORDER_BLOCK_K
from megatron_quads.kernels.w4a16 import (
    _DEQUANT_WORD_PTX,
    _OUT_DTYPES,
    _SCALE_HALF_PTX,
    _X_ORDER_BLOCK,
    OPERAND_LOG2_SCALE,
    _grouped_block_m,
    _operands,
    _sm_count,
    _split_counters,
    check_grouped_bf16_call,
)
from megatron_quads.kernels.code_orders import CODE_ORDERS
from megatron_quads.kernels.code_orders import DEQUANT_WORD_PTX as _ORDERED_DEQUANT_PTX
from megatron_quads.nvfp4.tensor import NVFP4Tensor

_ROTATED_DEQUANT_PTX = gl.constexpr(_ORDERED_DEQUANT_PTX[1])
_BALANCED_DEQUANT_PTX = gl.constexpr(_ORDERED_DEQUANT_PTX[2])

# --------------------------------------------------------------------------------------------------
# Register and shared-memory layouts of the weight operand (shared with w4a16_ws_dense)
# --------------------------------------------------------------------------------------------------

_SCALE_PAIRS_2_PTX = gl.constexpr(
    "{\n.reg .b32 w, v, t, u, c;\nmov.b32 c, 0x7B007B00;\ncvt.u32.u16 w, $2;"
    + _SCALE_HALF_PTX.replace("$4", "w").format(select="0x4140", lo=0, hi=1)
    + "}\n"
)
"""Two E4M3 scale bytes (one 16-bit register, the first in its low byte) to two bf16x2 pairs
``(s, s)``, ``s = scale * 2^118``: the scale conversion of the Triton kernels
(:data:`~megatron_quads.kernels.w4a16._SCALE_PAIRS_PTX`) for the 2-byte run a thread holds of a
128-wide K step."""


@gluon.constexpr_function
def _bits(n: int) -> list[int]:
    return [1 << b for b in range(n.bit_length() - 1)]


@gluon.constexpr_function
def _basis(rank: int, dim: int, value: int) -> list[int]:
    out = [0] * rank
    out[dim] = value
    return out


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
def scale_pairs_layout(block_n: int, num_warps: int) -> gl.DistributedLinearLayout:
    """Block scales of a 128-wide K step as uint16 ``[BN, 4]``: thread ``t`` of a quad holds the two
    scale bytes of its four words (bytes ``2 t, 2 t + 1`` of its rows), one 16-bit value a row. Loaded
    as such, they go to the conversion's 16-bit operand with no byte moves."""
    lanes, regs, warps = _row_bases(block_n, num_warps, 2)
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 1], [0, 2]] + lanes, warp_bases=warps,
                                      block_bases=[], shape=[block_n, 4])


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
    """The code-word ring's shared layout (also the TMA descriptor's): unswizzled rows of ``BK / 2``
    bytes; at ``BK = 128`` the 8 lanes of a quarter warp read 4 x 16 bytes of two consecutive rows,
    128 contiguous bytes (no bank conflict)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@gluon.jit
def _dequant_a(words, scale_pairs, A_LAYOUT: gl.constexpr, WORDS: gl.constexpr, CODE_ORDER: gl.constexpr = 0):
    """Words ``[BN, 4, 4]`` and scale pairs ``[BN, 4]`` (:func:`scale_pairs_layout`) of a 128-wide K step to the A operand
    ``[BN, 128]`` (bf16 ``e2m1 * e4m3 * 2^-8``) in MMA K order: word ``4 t + i``'s nibbles ``q`` and
    ``q + 4`` (``q = 2 q1 + q0``) become logical columns ``32 i + 16 q1 + 8 q0 + 2 t + (0, 1)``."""
    BN: gl.constexpr = words.shape[0]
    I: gl.constexpr = words.shape[2]
    gl.static_assert(I == 4, "_dequant_a takes the words of a 128-wide K step")
    first, second = gl.inline_asm_elementwise(_SCALE_PAIRS_2_PTX, "=r,=r,h", [scale_pairs],
                                              dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    pairs = gl.join(first, second)  # [BN, 4, 2]: the scales of words (0, 1) and (2, 3)
    pairs = gl.convert_layout(gl.reshape(gl.join(pairs, pairs), (BN, 4, I)), WORDS, assert_trivial=True)
    PTX: gl.constexpr = _ROTATED_DEQUANT_PTX if CODE_ORDER == 1 else (_BALANCED_DEQUANT_PTX if CODE_ORDER == 2
                                                                     else _DEQUANT_WORD_PTX)
    o = gl.inline_asm_elementwise(PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, pairs],
                                  dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
    # dims after the joins: (BN, t, i, h, q0, q1)
    v = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])), gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))
    v = gl.permute(v, (0, 2, 5, 4, 1, 3))  # (BN, i, q1, q0, t, h)
    return gl.convert_layout(gl.reshape(v, (BN, 32 * I)), A_LAYOUT, assert_trivial=True)


@gluon.jit
def _scale_pointers(scales_ptr, row0, N, stride_sn, BLOCK_N: gl.constexpr, SPAIRS: gl.constexpr):
    """uint16 pointers to the first 128-wide K step's scale pairs ``[BN, 4]`` of rows ``row0 ..``
    (rows past N clamped), in :func:`scale_pairs_layout` (a row's scale bytes start 2-byte aligned: K
    is a multiple of 128); the next step's are 4 further."""
    sr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SPAIRS))
    st = gl.arange(0, 4, layout=gl.SliceLayout(0, SPAIRS))
    s_rows = gl.minimum(row0 + sr, N - 1).to(gl.int64)
    rows = (scales_ptr + s_rows * stride_sn).to(gl.pointer_type(gl.uint16), bitcast=True)
    return rows[:, None] + st[None, :]


@gluon.constexpr_function
def wgmma_layout(block_m: int, num_warps: int) -> gl.NVMMADistributedLayout:
    """fp32 accumulator ``y^T [BN, BM]`` of the wgmma: warpgroups stacked along the weight rows (64 each)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16])


X_SUB_K = 64
"""x's K per shared-memory tile: one 128-byte swizzled line a token row (a K step holds BLOCK_K / 64)."""
_X_SUB_K = gl.constexpr(X_SUB_K)


@gluon.constexpr_function
def x_tile_layout(block_m: int) -> gl.NVMMASharedLayout:
    """The x ring's shared layout (and its TMA descriptor's): ``[BM, 64]`` bf16 tiles, one 128-byte
    swizzled line a token row (the wgmma's K-major B layout); a half-height box lands in the first
    ``BM / 2`` lines of a tile."""
    return gl.NVMMASharedLayout.get_default_for([block_m, X_SUB_K], gl.bfloat16)


@gluon.constexpr_function
def scales_ring_layout() -> gl.NVMMASharedLayout:
    """The scale ring's shared layout (and its TMA descriptor's): unswizzled rows of ``BK / 16`` bytes."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)


@gluon.constexpr_function
def scale_pairs_ring_layout() -> gl.NVMMASharedLayout:
    """A scale-ring stage read as uint16 (unswizzled, as the bytes landed)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


@gluon.jit
def _k_order_position(cols, BLOCK_K: gl.constexpr):
    """Where :func:`~megatron_quads.kernels.w4a16.mma_k_order_rows` puts column ``cols``
    (the Gluon twin of :func:`~megatron_quads.kernels.w4a16.mma_k_order_position`)."""
    I: gl.constexpr = BLOCK_K // 32
    e = cols % BLOCK_K
    i = (e >> 3) % I
    t = (e >> 3) // I
    return cols - e + 32 * i + 16 * ((e >> 1) & 1) + 8 * (e & 1) + 2 * t + ((e >> 2) & 1)


@gluon.jit
def _load_tile(tile, lo, hi, step, w_desc, x_desc, s_desc, t_desc, ts_desc, ring_w, ring_x, ring_s, ready, empty, N,
               k_main, k_steps, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
               STAGES: gl.constexpr, SCALE_RING: gl.constexpr, HAS_TAIL: gl.constexpr):
    """Every (token tile, K step) of (expert, N tile) pair ``tile`` (its expert's rows ``lo:hi``)
    into the ring from ring step ``step`` on: the weight rows' code words (and scale bytes), from
    the tail's descriptors ``t_desc`` / ``ts_desc`` for the steps past ``k_main`` (``HAS_TAIL``: x
    then holds ``K + K2`` columns), and x as ``BLOCK_K / 64`` tiles of ``[BM, 64]`` by half-height
    boxes (a half tile reads only the rows it multiplies); returns the next ring step."""
    SUB: gl.constexpr = BLOCK_K // _X_SUB_K
    HALF_X_BYTES: gl.constexpr = x_desc.block_type.nbytes * SUB
    FULL_BYTES: gl.constexpr = w_desc.block_type.nbytes + 2 * HALF_X_BYTES + SCALE_RING * s_desc.block_type.nbytes
    expert = tile // n_tiles
    row0 = expert * N + (tile % n_tiles) * BLOCK_N
    for m0 in range(lo, hi, BLOCK_M):
        half = (hi - m0 <= BLOCK_M // 2).to(gl.int32)  # as the MMA warps decide
        for kt in range(k_steps):
            stage = step % STAGES
            # a fresh mbarrier counts as having completed the phase before 0: the first lap waits on nothing
            mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, FULL_BYTES - HALF_X_BYTES, pred=half == 1)  # the byte count is a constant
            mbarrier.expect(bar, FULL_BYTES, pred=half == 0)
            if HAS_TAIL:  # the tail's boxes have the main weight's shape: same byte count
                main = kt < k_main
                kw = gl.where(main, kt, kt - k_main)
                tma.async_copy_global_to_shared(w_desc, [row0, kw * (BLOCK_K // 8)], bar, ring_w.index(stage), pred=main)
                tma.async_copy_global_to_shared(t_desc, [row0, kw * (BLOCK_K // 8)], bar, ring_w.index(stage),
                                                pred=kt >= k_main)
                tma.async_copy_global_to_shared(s_desc, [row0, kw * (BLOCK_K // 16)], bar, ring_s.index(stage),
                                                pred=main)
                tma.async_copy_global_to_shared(ts_desc, [row0, kw * (BLOCK_K // 16)], bar, ring_s.index(stage),
                                                pred=kt >= k_main)
            else:
                tma.async_copy_global_to_shared(w_desc, [row0, kt * (BLOCK_K // 8)], bar, ring_w.index(stage))
                if SCALE_RING:
                    tma.async_copy_global_to_shared(s_desc, [row0, kt * (BLOCK_K // 16)], bar, ring_s.index(stage))
            for j in gl.static_range(SUB):  # x's rows m0 .. m0 + BM (the first half only for a half tile)
                x_tile = ring_x.index(stage * SUB + j)
                k0 = kt * BLOCK_K + j * _X_SUB_K
                tma.async_copy_global_to_shared(x_desc, [m0, k0], bar, x_tile.slice(0, BLOCK_M // 2))
                tma.async_copy_global_to_shared(x_desc, [m0 + BLOCK_M // 2, k0], bar,
                                                x_tile.slice(BLOCK_M // 2, BLOCK_M // 2), pred=half == 0)
            step += 1
    return step


@gluon.jit
def _expert_params(tile, n_tiles, offsets_ptr, ws2_ptr, stride_w2):
    """``(lo, hi, weight_scale_2)`` of pair ``tile``'s expert: its rows ``lo:hi`` and decode scale."""
    expert = tile // n_tiles
    return gl.load(offsets_ptr + expert), gl.load(offsets_ptr + expert + 1), gl.load(ws2_ptr + expert * stride_w2)


@gluon.jit
def _publish_tile(count, tile, lo, hi, scale_bits, queue, queued, taken):
    """The loader's ``count``-th tile into the tile queue (slot ``count % slots``, once the MMA warps
    are done with what it held): its id, its expert's rows ``lo:hi`` and the bits of its
    ``weight_scale_2`` (loaded by the loader, so the MMA warps do not wait on them at each tile)."""
    SLOTS: gl.constexpr = queue.shape[0]
    slot = count % SLOTS
    mbarrier.wait(taken.index(slot), ((count // SLOTS) & 1) ^ 1)
    field = gl.arange(0, 4, layout=gl.BlockedLayout([4], [32], [1], [0]))
    entry = gl.where(field == 0, tile, gl.where(field == 1, lo, gl.where(field == 2, hi, scale_bits)))
    queue.index(slot).store(entry)
    mbarrier.arrive(queued.index(slot), count=1)


@gluon.jit
def _queue_field(count, queue, j: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Field ``j`` of the ``count``-th queue entry (every thread loads the whole entry: no exchange)."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [NUM_WARPS], [0])
    entry = queue.index(count % queue.shape[0]).load(layout)
    return gl.sum(gl.where(gl.arange(0, 4, layout=layout) == j, entry, 0), axis=0)


@gluon.jit
def _peek_tile(count, queue, queued, NUM_WARPS: gl.constexpr):
    """The id of the ``count``-th tile the loader published (its slot stays held)."""
    SLOTS: gl.constexpr = queue.shape[0]
    mbarrier.wait(queued.index(count % SLOTS), (count // SLOTS) & 1)
    return _queue_field(count, queue, 0, NUM_WARPS)


@gluon.jit
def _take_tile(count, queue, taken, NUM_WARPS: gl.constexpr):
    """``(lo, hi, weight_scale_2)`` of the ``count``-th published tile (after :func:`_peek_tile`),
    and its slot back to the loader. Read at the top of a tile, not carried across the tile loop:
    the Gluon frontend of Triton 3.6 does not carry a value whose only use is a ``range`` bound."""
    lo = _queue_field(count, queue, 1, NUM_WARPS)
    hi = _queue_field(count, queue, 2, NUM_WARPS)
    weight_scale_2 = _queue_field(count, queue, 3, NUM_WARPS).to(gl.float32, bitcast=True)
    mbarrier.arrive(taken.index(count % queue.shape[0]), count=1)
    return lo, hi, weight_scale_2


@gluon.jit
def _load_partition(w_desc, x_desc, s_desc, t_desc, ts_desc, ring_w, ring_x, ring_s, ready, empty, queue, queued, taken,
                    offsets_ptr, ws2_ptr, sched_ptr, N, K, K2, num_tiles, n_tiles, stride_w2, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, SCALE_RING: gl.constexpr,
                    DYNAMIC: gl.constexpr, HAS_TAIL: gl.constexpr):
    """The loader warp: the program's tiles (:func:`_load_tile`) in the MMA warps' order. Static:
    tiles ``p, p + P, ...``. ``DYNAMIC``: tile ``p``, then whichever tile the shared counter at
    ``sched_ptr`` hands out next (taken one tile ahead, so its latency hides behind the loads), each
    id published to the MMA warps through the tile queue with its expert's row bounds and
    ``weight_scale_2`` (:func:`_publish_tile`), an id past the last one ending both; the last program
    to finish puts the counters back to zero for the next launch."""
    k_main = K // BLOCK_K
    k_steps = (K + K2) // BLOCK_K
    step = 0
    if DYNAMIC:
        programs = gl.num_programs(0)
        tile = gl.program_id(0)
        count = 0
        while tile < num_tiles:
            next_tile = gl.atomic_add(sched_ptr, 1, sem="relaxed") + programs
            lo, hi, weight_scale_2 = _expert_params(tile, n_tiles, offsets_ptr, ws2_ptr, stride_w2)
            _publish_tile(count, tile, lo, hi, weight_scale_2.to(gl.int32, bitcast=True), queue, queued, taken)
            step = _load_tile(tile, lo, hi, step, w_desc, x_desc, s_desc, t_desc, ts_desc, ring_w, ring_x, ring_s,
                              ready, empty, N, k_main, k_steps, n_tiles, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, SCALE_RING,
                              HAS_TAIL)
            count += 1
            tile = next_tile
        _publish_tile(count, tile, 0, 0, 0, queue, queued, taken)  # past the last pair: the MMA warps stop
        # every program takes exactly one id past the last before it gets here, so the last one to
        # arrive knows nobody reads the counter again in this launch
        if gl.atomic_add(sched_ptr + 1, 1, sem="acq_rel") == programs - 1:
            gl.atomic_xchg(sched_ptr, 0, sem="relaxed")
            gl.atomic_xchg(sched_ptr + 1, 0, sem="relaxed")
    else:
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            lo, hi, _ = _expert_params(tile, n_tiles, offsets_ptr, ws2_ptr, stride_w2)
            step = _load_tile(tile, lo, hi, step, w_desc, x_desc, s_desc, t_desc, ts_desc, ring_w, ring_x, ring_s,
                              ready, empty, N, k_main, k_steps, n_tiles, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, SCALE_RING,
                              HAS_TAIL)


@gluon.jit
def _read_words(ring_w, ready, step, sub, STAGES: gl.constexpr, WTILE: gl.constexpr, WORDS: gl.constexpr,
                WAIT: gl.constexpr = True, ROW0: gl.constexpr = 0):
    """The code words ``[BN, 4, I]`` of 128-wide sub-step ``sub`` of ring step ``step`` in the A
    operand's registers (``WAIT``: once the stage has landed), from row ``ROW0`` of the stage."""
    stage = step % STAGES
    if WAIT:
        mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
    BLOCK_N: gl.constexpr = WORDS.shape[0]
    I: gl.constexpr = WORDS.shape[2]
    words = ring_w.index(stage)
    if words.shape[0] > BLOCK_N:
        words = words.slice(ROW0, BLOCK_N, dim=0)
    if words.shape[1] > 4 * I:
        words = words.slice(sub * 4 * I, 4 * I, dim=1)
    return gl.convert_layout(gl.reshape(words.load(WTILE), (BLOCK_N, 4, I)), WORDS, assert_trivial=True)


@gluon.jit
def _read_scales(ring_s, step, sub, STAGES: gl.constexpr, SPAIRS: gl.constexpr, ROW0: gl.constexpr = 0):
    """The scale pairs ``[BN, 4]`` of 128-wide sub-step ``sub`` of ring step ``step`` (landed with the
    stage's words: read after their wait), from row ``ROW0`` of the stage."""
    stage = ring_s.index(step % STAGES)
    tile = stage._reinterpret(gl.uint16, [stage.shape[0], stage.shape[1] // 2], scale_pairs_ring_layout())
    if tile.shape[0] > SPAIRS.shape[0]:
        tile = tile.slice(ROW0, SPAIRS.shape[0], dim=0)
    return tile.slice(sub * 4, 4, dim=1).load(SPAIRS)


@gluon.jit
def _k_halves(a, A_HALF: gl.constexpr):
    """The A operand ``[BN, 128]`` as its K positions ``0..63`` and ``64..127`` (registers of k16
    slices 0-3 and 4-7: a renaming)."""
    BLOCK_N: gl.constexpr = a.shape[0]
    lo, hi = gl.split(gl.permute(gl.reshape(a, (BLOCK_N, 2, _X_SUB_K)), (0, 2, 1)))
    return gl.convert_layout(lo, A_HALF, assert_trivial=True), gl.convert_layout(hi, A_HALF, assert_trivial=True)


@gluon.jit
def _x_operand(ring_x, index, TILE_M: gl.constexpr):
    """x tile ``index`` of the ring as the wgmma's B operand ``[64, TILE_M]`` (its first ``TILE_M`` rows)."""
    tile = ring_x.index(index)
    if TILE_M < tile.shape[0]:
        tile = tile.slice(0, TILE_M, dim=0)
    return tile.permute((1, 0))


@gluon.jit
def _k_loop(acc, ring_w, ring_x, ring_s, ready, empty, s_ptrs, step, k_steps,
            BLOCK_K: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, SCALE_RING: gl.constexpr,
            ROW0: gl.constexpr = 0, A_PIPE: gl.constexpr = 0, CODE_ORDER: gl.constexpr = 0):
    """``acc [BN, BM'] += dq(W) @ x^T`` over all K steps of one token tile (``BM'`` the first rows of
    each x stage), ring steps ``step ..``; returns ``(acc, next step)``. A step of ``BLOCK_K`` 256
    is two 128-wide sub-steps (x's K order is per 128 columns) behind one ring wait and release.

    The wgmma reads its A operand from registers asynchronously, so the next sub-step's
    dequantization (which the compiler puts in the same registers: Triton keeps the bf16 values
    alive to the wait, not the packed registers the wgmma reads) waits for it; what overlaps the MMA
    in a warp is the next sub-step's ring wait and shared-memory reads, and across warps the other
    warpgroups' work."""
    if A_PIPE:
        return _k_loop_overlapped(acc, ring_w, ring_x, ring_s, ready, empty, step, k_steps, BLOCK_K, STAGES,
                                  NUM_WARPS, ROW0, CODE_ORDER)
    BLOCK_N: gl.constexpr = acc.shape[0]
    TILE_M: gl.constexpr = acc.shape[1]
    SUBS: gl.constexpr = BLOCK_K // _X_ORDER_BLOCK
    MMA: gl.constexpr = wgmma_layout(TILE_M, NUM_WARPS)
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    A_HALF: gl.constexpr = A_LAYOUT  # the same register map on a [BN, 64] operand
    WORDS: gl.constexpr = words_layout(BLOCK_N, _X_ORDER_BLOCK, NUM_WARPS)
    WTILE: gl.constexpr = words_tile_layout(BLOCK_N, _X_ORDER_BLOCK, NUM_WARPS)
    SPAIRS: gl.constexpr = scale_pairs_layout(BLOCK_N, NUM_WARPS)
    last = k_steps * SUBS - 1
    if not SCALE_RING:
        s0 = gl.load(s_ptrs)
    words = _read_words(ring_w, ready, step, 0, STAGES, WTILE, WORDS, ROW0=ROW0)
    if SCALE_RING:
        s0 = _read_scales(ring_s, step, 0, STAGES, SPAIRS, ROW0)
    for kt in range(k_steps):
        stage = step % STAGES
        for j in gl.static_range(SUBS):
            if not SCALE_RING:  # the next sub-step's scale pairs from global memory, one sub-step ahead
                s1 = gl.load(s_ptrs + gl.minimum(kt * SUBS + j + 1, last) * (_X_ORDER_BLOCK // 32))
            a_lo, a_hi = _k_halves(_dequant_a(words, s0, A_LAYOUT, WORDS, CODE_ORDER), A_HALF)
            x0 = (stage * SUBS + j) * 2
            acc = warpgroup_mma(a_lo, _x_operand(ring_x, x0, TILE_M), acc, is_async=True)
            acc = warpgroup_mma(a_hi, _x_operand(ring_x, x0 + 1, TILE_M), acc, is_async=True)
            # the next sub-step's words while the MMA runs (the last one reads its own stage again: still held)
            if j + 1 < SUBS:
                words = _read_words(ring_w, ready, step, j + 1, STAGES, WTILE, WORDS, WAIT=False, ROW0=ROW0)
                if SCALE_RING:
                    s1 = _read_scales(ring_s, step, j + 1, STAGES, SPAIRS, ROW0)
            else:
                words = _read_words(ring_w, ready, step + (kt + 1 < k_steps), 0, STAGES, WTILE, WORDS, ROW0=ROW0)
                if SCALE_RING:
                    s1 = _read_scales(ring_s, step + (kt + 1 < k_steps), 0, STAGES, SPAIRS, ROW0)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            s0 = s1
        mbarrier.arrive(empty.index(stage), count=1)  # the stage goes back to the loader
        step += 1
    return acc, step


@gluon.jit
def _k_loop_overlapped(acc, ring_w, ring_x, ring_s, ready, empty, step, k_steps, BLOCK_K: gl.constexpr,
                       STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, ROW0: gl.constexpr = 0,
                       CODE_ORDER: gl.constexpr = 0):
    """:func:`_k_loop` (scale bytes in the ring) with each sub-step's dequantization while the previous
    sub-step's wgmma run: the wait for them comes after it, and names their A operand among its
    dependencies so that the compiler keeps it in its own registers until they retire. The same
    wgmma on the same operands in the same order, so the same bits. After the tile's last sub-step it
    dequantizes its own stage's first sub-step again, unused: a branch there instead made the
    compiler copy the A operand between registers at every step."""
    BLOCK_N: gl.constexpr = acc.shape[0]
    TILE_M: gl.constexpr = acc.shape[1]
    SUBS: gl.constexpr = BLOCK_K // _X_ORDER_BLOCK
    MMA: gl.constexpr = wgmma_layout(TILE_M, NUM_WARPS)
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    WORDS: gl.constexpr = words_layout(BLOCK_N, _X_ORDER_BLOCK, NUM_WARPS)
    WTILE: gl.constexpr = words_tile_layout(BLOCK_N, _X_ORDER_BLOCK, NUM_WARPS)
    SPAIRS: gl.constexpr = scale_pairs_layout(BLOCK_N, NUM_WARPS)
    words = _read_words(ring_w, ready, step, 0, STAGES, WTILE, WORDS, ROW0=ROW0)
    a_lo, a_hi = _k_halves(_dequant_a(words, _read_scales(ring_s, step, 0, STAGES, SPAIRS, ROW0), A_LAYOUT, WORDS,
                                      CODE_ORDER), A_LAYOUT)
    for kt in range(k_steps):
        stage = step % STAGES
        for j in gl.static_range(SUBS):
            x0 = (stage * SUBS + j) * 2
            acc = warpgroup_mma(a_lo, _x_operand(ring_x, x0, TILE_M), acc, is_async=True)
            acc = warpgroup_mma(a_hi, _x_operand(ring_x, x0 + 1, TILE_M), acc, is_async=True)
            if j + 1 < SUBS:
                words = _read_words(ring_w, ready, step, j + 1, STAGES, WTILE, WORDS, WAIT=False, ROW0=ROW0)
                n_lo, n_hi = _k_halves(_dequant_a(words, _read_scales(ring_s, step, j + 1, STAGES, SPAIRS, ROW0),
                                                  A_LAYOUT, WORDS, CODE_ORDER), A_LAYOUT)
            else:  # the next stage's first sub-step (the last step: its own stage again, still held)
                nxt = step + (kt + 1 < k_steps)
                words = _read_words(ring_w, ready, nxt, 0, STAGES, WTILE, WORDS, ROW0=ROW0)
                n_lo, n_hi = _k_halves(_dequant_a(words, _read_scales(ring_s, nxt, 0, STAGES, SPAIRS, ROW0),
                                                  A_LAYOUT, WORDS, CODE_ORDER), A_LAYOUT)
            acc, a_lo, a_hi = warpgroup_mma_wait(num_outstanding=0, deps=[acc, a_lo, a_hi])
            a_lo = n_lo
            a_hi = n_hi
        mbarrier.arrive(empty.index(stage), count=1)  # the stage goes back to the loader
        step += 1
    return acc, step


@gluon.jit
def _store_rows(acc, y_ptr, weight_scale_2, row_scale_ptr, row0, N, m0, hi, stride_ym, NUM_WARPS: gl.constexpr,
                Y_MMA_ORDER: gl.constexpr, EVEN_N: gl.constexpr, Y_I32: gl.constexpr, ROW_SCALE: gl.constexpr):
    """``y[m, n] = cast(acc[n, m] * decode)`` for ``n < N`` (every ``n`` with ``EVEN_N``) and
    ``m0 <= m < hi``, ``decode`` the operands' exact rescale times ``weight_scale_2`` (times
    ``row_scale[m]`` first with ``ROW_SCALE``: the W4A4 ``alpha``, in the Triton epilogue's order of
    operations); ``Y_MMA_ORDER`` stores column ``n`` at its K-order position. The stores
    follow the wgmma layout (a thread holds adjacent tokens, not adjacent columns), so the addresses
    are kept cheap: a pointer a token, 32-bit offsets where ``Y_I32`` says ``y`` allows them, a mask
    a token (or column) rather than an element."""
    MMA: gl.constexpr = wgmma_layout(acc.shape[1], NUM_WARPS)
    on = row0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, MMA))
    om = m0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, MMA))
    cols = _k_order_position(on, _X_ORDER_BLOCK) if Y_MMA_ORDER else on
    if Y_I32:  # 32-bit offsets: with the per-token masks, 284 instead of 387 SASS instructions a 64-row tile
        rows = y_ptr + om * stride_ym
    else:
        rows = y_ptr + om.to(gl.int64) * stride_ym
    mask = (om < hi)[None, :]
    if not EVEN_N:
        mask = mask & (on < N)[:, None]
    if ROW_SCALE:
        alpha = gl.load(row_scale_ptr + om, mask=om < hi, other=0.0) * weight_scale_2
        decode = (alpha * (2.0 ** -OPERAND_LOG2_SCALE))[None, :]
    else:
        decode = weight_scale_2 * (2.0 ** -OPERAND_LOG2_SCALE)
    gl.store(rows[None, :] + cols[:, None], (acc * decode).to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _token_tile(TILE_M: gl.constexpr, ring_w, ring_x, ring_s, ready, empty, s_ptrs, step, k_steps, y_ptr,
                weight_scale_2, row_scale_ptr, n0, N, m0, hi, stride_ym, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, Y_MMA_ORDER: gl.constexpr, EVEN_N: gl.constexpr,
                Y_I32: gl.constexpr, SCALE_RING: gl.constexpr, ROW_SCALE: gl.constexpr, ROW0: gl.constexpr = 0,
                A_PIPE: gl.constexpr = 0, CODE_ORDER: gl.constexpr = 0):
    """Rows ``m0 .. hi`` (at most ``TILE_M``: the first rows of each x tile) times the N tile
    (output columns ``n0 ..``) over the whole K, stored; returns the next ring step."""
    acc = gl.zeros((BLOCK_N, TILE_M), gl.float32, layout=wgmma_layout(TILE_M, NUM_WARPS))
    acc, step = _k_loop(acc, ring_w, ring_x, ring_s, ready, empty, s_ptrs, step, k_steps, BLOCK_K, STAGES, NUM_WARPS,
                        SCALE_RING, ROW0, A_PIPE, CODE_ORDER)
    _store_rows(acc, y_ptr, weight_scale_2, row_scale_ptr, n0, N, m0, hi, stride_ym, NUM_WARPS, Y_MMA_ORDER, EVEN_N,
                Y_I32, ROW_SCALE)
    return step


@gluon.jit
def _mma_tile(tile, lo, hi, weight_scale_2, step, ring_w, ring_x, ring_s, ready, empty, scales_ptr, y_ptr, row_scale_ptr,
              N, k_steps, n_tiles, stride_se, stride_sn, stride_ym,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              NUM_WARPS: gl.constexpr, Y_MMA_ORDER: gl.constexpr, EVEN_N: gl.constexpr, Y_I32: gl.constexpr,
              SCALE_RING: gl.constexpr, ROW_SCALE: gl.constexpr, N_TILE: gl.constexpr, ROW0: gl.constexpr,
              A_PIPE: gl.constexpr = 0, CODE_ORDER: gl.constexpr = 0):
    """(expert, N tile) pair ``tile`` (its expert's rows ``lo:hi``): its token tiles in the loader's
    order, each over the whole K from ring step ``step`` on, then stored; returns the next ring step.
    The pair's N tile is ``N_TILE`` rows wide, of which these warps compute ``BLOCK_N`` from ``ROW0``."""
    SPAIRS: gl.constexpr = scale_pairs_layout(BLOCK_N, NUM_WARPS)  # a 128-wide sub-step's
    expert = tile // n_tiles
    n0 = (tile % n_tiles) * N_TILE + ROW0
    s_ptrs = _scale_pointers(scales_ptr + expert.to(gl.int64) * stride_se, n0, N, stride_sn, BLOCK_N, SPAIRS)
    for m0 in range(lo, hi, BLOCK_M):
        if hi - m0 <= BLOCK_M // 2:  # the last (often only) tile of a small expert: a half-width tile
            step = _token_tile(BLOCK_M // 2, ring_w, ring_x, ring_s, ready, empty, s_ptrs, step, k_steps, y_ptr,
                               weight_scale_2, row_scale_ptr, n0, N, m0, hi, stride_ym, BLOCK_N, BLOCK_K, STAGES,
                               NUM_WARPS, Y_MMA_ORDER, EVEN_N, Y_I32, SCALE_RING, ROW_SCALE, ROW0, A_PIPE, CODE_ORDER)
        else:
            step = _token_tile(BLOCK_M, ring_w, ring_x, ring_s, ready, empty, s_ptrs, step, k_steps, y_ptr,
                               weight_scale_2, row_scale_ptr, n0, N, m0, hi, stride_ym, BLOCK_N, BLOCK_K, STAGES,
                               NUM_WARPS, Y_MMA_ORDER, EVEN_N, Y_I32, SCALE_RING, ROW_SCALE, ROW0, A_PIPE, CODE_ORDER)
    return step


@gluon.jit
def _mma_partition(ring_w, ring_x, ring_s, ready, empty, queue, queued, taken, scales_ptr, ws2_ptr, offsets_ptr, y_ptr,
                   row_scale_ptr, N, K, K2, num_tiles, n_tiles, stride_se, stride_sn, stride_w2, stride_ym,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                   NUM_WARPS: gl.constexpr, Y_MMA_ORDER: gl.constexpr, EVEN_N: gl.constexpr,
                   Y_I32: gl.constexpr, SCALE_RING: gl.constexpr, DYNAMIC: gl.constexpr,
                   ROW_SCALE: gl.constexpr, N_TILE: gl.constexpr, ROW0: gl.constexpr, A_PIPE: gl.constexpr = 0,
                   CODE_ORDER: gl.constexpr = 0):
    """MMA warps (``NUM_WARPS``): the program's tiles in the loader's order (``DYNAMIC``: as the tile
    queue gives them), each stored while the loader already fills the ring for the next. They compute
    rows ``ROW0 .. ROW0 + BLOCK_N`` of each ``N_TILE``-row tile (``WG_SPLIT``: one warpgroup a
    partition, each reading its own rows of the ring stages)."""
    k_steps = (K + K2) // BLOCK_K
    step = 0
    if DYNAMIC:
        count = 0
        tile = _peek_tile(count, queue, queued, NUM_WARPS)
        while tile < num_tiles:
            lo, hi, weight_scale_2 = _take_tile(count, queue, taken, NUM_WARPS)
            step = _mma_tile(tile, lo, hi, weight_scale_2, step, ring_w, ring_x, ring_s, ready, empty, scales_ptr,
                             y_ptr, row_scale_ptr, N, k_steps, n_tiles, stride_se, stride_sn, stride_ym, BLOCK_M,
                             BLOCK_N, BLOCK_K, STAGES, NUM_WARPS, Y_MMA_ORDER, EVEN_N, Y_I32, SCALE_RING,
                             ROW_SCALE, N_TILE, ROW0, A_PIPE, CODE_ORDER)
            count += 1
            tile = _peek_tile(count, queue, queued, NUM_WARPS)
    else:
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            lo, hi, weight_scale_2 = _expert_params(tile, n_tiles, offsets_ptr, ws2_ptr, stride_w2)
            step = _mma_tile(tile, lo, hi, weight_scale_2, step, ring_w, ring_x, ring_s, ready, empty, scales_ptr,
                             y_ptr, row_scale_ptr, N, k_steps, n_tiles, stride_se, stride_sn, stride_ym, BLOCK_M,
                             BLOCK_N, BLOCK_K, STAGES, NUM_WARPS, Y_MMA_ORDER, EVEN_N, Y_I32, SCALE_RING,
                             ROW_SCALE, N_TILE, ROW0, A_PIPE, CODE_ORDER)


TILE_QUEUE_SLOTS = 4
"""Tile ids in flight from the loader to the MMA warps (``DYNAMIC``); the ring already keeps the
loader within ``STAGES`` K steps of them, so this only has to not be the tighter bound."""
_TILE_QUEUE_SLOTS = gl.constexpr(TILE_QUEUE_SLOTS)


@gluon.jit
def _grouped_ws_kernel(
    w_desc, x_desc, s_desc, t_desc, ts_desc, scales_ptr, ws2_ptr, offsets_ptr, sched_ptr, y_ptr, row_scale_ptr,
    N, K, K2, num_tiles, n_tiles, stride_se, stride_sn, stride_w2, stride_ym,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    NUM_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, Y_MMA_ORDER: gl.constexpr,
    EVEN_N: gl.constexpr, Y_I32: gl.constexpr, SCALE_RING: gl.constexpr, DYNAMIC: gl.constexpr,
    HAS_TAIL: gl.constexpr, ROW_SCALE: gl.constexpr, WG_SPLIT: gl.constexpr, MMA_REGS: gl.constexpr,
    A_PIPE: gl.constexpr, CODE_ORDER: gl.constexpr,
):
    """Persistent: the ``E * n_tiles`` (expert, N tile) pairs, expert-major (programs running together
    share an expert's x in L2), program ``p`` taking ``p, p + P, ...`` or (``DYNAMIC``) ``p`` and then
    the next untaken pair whenever its loader is ready for one; each covers the expert's rows
    ``offsets[e]:offsets[e+1]`` in token tiles of ``BLOCK_M`` (``w_desc`` over the stacked
    ``[E * N, K / 8]`` words). ``sched_ptr``: two int32 zeros (``DYNAMIC``), left zero. ``HAS_TAIL``:
    the reduction runs on over the tail weight's ``K2`` columns (``t_desc`` / ``ts_desc``, its words
    and scale bytes stacked as the weight's; x rows hold ``K + K2`` values, the tail's in K order
    too); ``ROW_SCALE``: the epilogue's factor is ``row_scale[m] * weight_scale_2`` (W4A4 + RAC).
    ``WG_SPLIT``: the two MMA warpgroups of a 128-row tile run as two partitions (the second a worker
    of ``MMA_REGS`` registers), each waiting on the ring and releasing its stages by itself, so that
    their warps synchronize within a warpgroup only; the kernel is then launched with 4 warps."""
    ring_w = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], words_ring_layout())
    ring_x = gl.allocate_shared_memory(gl.bfloat16, [STAGES * (BLOCK_K // _X_SUB_K), BLOCK_M, _X_SUB_K],
                                       x_tile_layout(BLOCK_M))
    if SCALE_RING:
        ring_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_K // 16], scales_ring_layout())
    else:
        ring_s = ring_w  # not read
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    PARTS: gl.constexpr = 2 if WG_SPLIT else 1  # MMA partitions: each releases a stage and a queue slot
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=PARTS)
    SLOTS: gl.constexpr = _TILE_QUEUE_SLOTS if DYNAMIC else 1
    queue = gl.allocate_shared_memory(gl.int32, [SLOTS, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    queued = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    taken = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    if DYNAMIC:
        for j in gl.static_range(SLOTS):
            mbarrier.init(queued.index(j), count=1)
            mbarrier.init(taken.index(j), count=PARTS)
    if WG_SPLIT:
        PART_N: gl.constexpr = BLOCK_N // 2
        PART_WARPS: gl.constexpr = NUM_WARPS // 2
        gl.warp_specialize([
            (_mma_partition, (ring_w, ring_x, ring_s, ready, empty, queue, queued, taken, scales_ptr, ws2_ptr,
                              offsets_ptr, y_ptr, row_scale_ptr, N, K, K2, num_tiles, n_tiles, stride_se, stride_sn,
                              stride_w2, stride_ym, BLOCK_M, PART_N, BLOCK_K, STAGES, PART_WARPS, Y_MMA_ORDER,
                              EVEN_N, Y_I32, SCALE_RING, DYNAMIC, ROW_SCALE, BLOCK_N, 0, A_PIPE, CODE_ORDER)),
            (_mma_partition, (ring_w, ring_x, ring_s, ready, empty, queue, queued, taken, scales_ptr, ws2_ptr,
                              offsets_ptr, y_ptr, row_scale_ptr, N, K, K2, num_tiles, n_tiles, stride_se, stride_sn,
                              stride_w2, stride_ym, BLOCK_M, PART_N, BLOCK_K, STAGES, PART_WARPS, Y_MMA_ORDER,
                              EVEN_N, Y_I32, SCALE_RING, DYNAMIC, ROW_SCALE, BLOCK_N, PART_N, A_PIPE, CODE_ORDER)),
            (_load_partition, (w_desc, x_desc, s_desc, t_desc, ts_desc, ring_w, ring_x, ring_s, ready, empty, queue,
                               queued, taken, offsets_ptr, ws2_ptr, sched_ptr, N, K, K2, num_tiles, n_tiles, stride_w2,
                               BLOCK_M, BLOCK_N, BLOCK_K, STAGES, SCALE_RING, DYNAMIC, HAS_TAIL)),
        ], [PART_WARPS, 1], [MMA_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_mma_partition, (ring_w, ring_x, ring_s, ready, empty, queue, queued, taken, scales_ptr, ws2_ptr, offsets_ptr,
                              y_ptr, row_scale_ptr, N, K, K2, num_tiles, n_tiles, stride_se, stride_sn, stride_w2,
                              stride_ym, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, NUM_WARPS, Y_MMA_ORDER, EVEN_N, Y_I32,
                              SCALE_RING, DYNAMIC, ROW_SCALE, BLOCK_N, 0, A_PIPE, CODE_ORDER)),
            (_load_partition, (w_desc, x_desc, s_desc, t_desc, ts_desc, ring_w, ring_x, ring_s, ready, empty, queue, queued,
                               taken, offsets_ptr, ws2_ptr, sched_ptr, N, K, K2, num_tiles, n_tiles, stride_w2, BLOCK_M,
                               BLOCK_N, BLOCK_K, STAGES, SCALE_RING, DYNAMIC, HAS_TAIL)),
        ], [1], [LOADER_REGS])


DEFAULT_CONFIG = {"BLOCK_N": 128, "BLOCK_K": 128, "STAGES": 3, "num_warps": 8, "LOADER_REGS": 40, "CTAS_PER_SM": 2,
                  "maxnreg": 80}
"""``num_warps`` (the MMA warps) must be ``BLOCK_N / 16``: one warpgroup a 64 weight rows. The grid is
``CTAS_PER_SM`` programs an SM (persistent), or ``PROGRAMS`` when the config gives it; ``maxnreg``
the register budget the partitions split (0: the compiler's; two CTAs of 12 warps an SM need 80 or
fewer). ``BLOCK_K`` 256 brings the scale bytes through the ring (TMA rows of 16 bytes or more);
``WG_SPLIT`` (``BLOCK_N`` 128): each MMA warpgroup its own partition, so that no CTA barrier
spans both (``MMA_REGS`` registers for the second); ``A_PIPE`` (``BLOCK_K`` 256): each sub-step
dequantized while the previous one's wgmma run; ``CODE_ORDER``: the weight's (and tail's) code words
are in that order of :mod:`~megatron_quads.kernels.code_orders` (``ordered_weight``), which the
kernel dequantizes in fewer instructions; ``DYNAMIC``: tiles handed out by a shared counter
as programs free up instead of ``p, p + P, ...``
(a token tile of 33-64 rows costs about twice one of 32 or fewer, so the static split ends
unevenly). :func:`default_config` puts :data:`WIDE_K_CONFIG` or :data:`SHORT_K_CONFIG` over it: the fastest at Qwen3-30B-A3B expert shapes in
``benchmarks/bench_kernels.py --only grouped_ws`` (docs/kernels.md)."""

WIDE_K_CONFIG = {"BLOCK_K": 256, "STAGES": 2, "DYNAMIC": 1}
"""Where 256 divides K: two 128-wide sub-steps a ring stage (one ring wait and release, and their CTA
barriers, a 256 K), the scale bytes in the ring (instead of the MMA warps' global loads one sub-step
ahead, which nothing hides at a tile's first step) and the ``DYNAMIC`` schedule: with tokens spread
over the experts as a trained router spreads them (the busiest expert 2.4-8x the mean), it was as fast
or up to 10% faster than the static split at both Qwen3-30B-A3B expert shapes from 8 to 512 tokens
(``tools/tune_grouped_w4a16.py``, benchmarks/results/grouped_tiles_gpu.json)."""

MMA_REGS = 96
"""Registers a thread of the second MMA warpgroup's partition (``WG_SPLIT``) asks for. Under
``maxnreg`` 80 and a 40-register loader Triton gives the first (default) partition what is left of
the CTA's 384 x 80: 104, so both get at least the 96 of the unsplit kernel's MMA warps."""

SHORT_K_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "STAGES": 3, "CTAS_PER_SM": 3}
"""One warpgroup, three CTAs an SM, for K below 1024 that 256 does not divide (``BLOCK_K`` 128)."""


def default_config(k: int) -> dict[str, int]:
    """The default config for an expert weight of ``k`` input features."""
    if k % 256 == 0:
        return {**DEFAULT_CONFIG, **WIDE_K_CONFIG}
    return {**DEFAULT_CONFIG, **(SHORT_K_CONFIG if k < 1024 else {})}


def check_config(cfg: dict[str, Any], n: int, k: int) -> None:
    """Raise unless ``cfg`` tiles an ``[N, K]`` expert weight the way :func:`_grouped_ws_kernel` needs."""
    block_m, block_n, block_k, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    if block_k not in (X_ORDER_BLOCK_K, 2 * X_ORDER_BLOCK_K) or k % block_k:
        raise ValueError(f"BLOCK_K must be {X_ORDER_BLOCK_K} (x's K order) or twice that and divide K={k}, got {cfg}")
    if block_n not in (64, 128, 256) or warps != block_n // 16:
        raise ValueError(f"BLOCK_N must be 64, 128 or 256 with num_warps = BLOCK_N / 16 (a warpgroup a 64 rows), "
                         f"got {cfg}")
    if cfg.get("CODE_ORDER", 0) not in (0, *CODE_ORDERS):
        raise ValueError(f"CODE_ORDER must be 0 (plain codes) or one of {CODE_ORDERS} (kernels.code_orders), got {cfg}")
    if cfg.get("A_PIPE") and not _scale_ring(cfg):
        raise ValueError(f"A_PIPE overlaps the dequantization with the wgmma where the scale bytes come through "
                         f"the ring: BLOCK_K must be {2 * X_ORDER_BLOCK_K}, got {cfg}")
    if cfg.get("WG_SPLIT") and block_n != 128:
        raise ValueError(f"WG_SPLIT splits the two MMA warpgroups of a 128-row tile: BLOCK_N must be 128, got {cfg}")
    if block_m not in (16, 32, 64, 128) or cfg["STAGES"] not in range(2, 9):
        raise ValueError(f"BLOCK_M must be 16, 32, 64 or 128 and STAGES 2..8, got {cfg}")
    stage_bytes = block_n * block_k // 2 + block_m * block_k * 2 + (block_n * block_k // 16 if _scale_ring(cfg) else 0)
    if cfg["STAGES"] * stage_bytes > 200 * 1024:
        raise ValueError(f"{cfg['STAGES']} ring stages of {stage_bytes} bytes do not fit in shared memory; lower "
                         "STAGES, BLOCK_N or BLOCK_M")


def tail_step(k: int) -> int:
    """The ring step a tail (W4A4 + RAC) must fill whole with the default config for ``k``: its
    ``BLOCK_K`` where the scale bytes come through the ring (256), else 0 (no tail)."""
    cfg = default_config(k)
    return cfg["BLOCK_K"] if _scale_ring(cfg) else 0


def takes_tail(k: int, k2: int) -> bool:
    """Whether the default config for ``k`` can run a tail of ``k2`` columns: whole :func:`tail_step` steps."""
    step = tail_step(k)
    return step > 0 and k2 % step == 0


def grouped_w4a16_ws_into(x: torch.Tensor, weight: NVFP4Tensor, expert_offsets: torch.Tensor, out: torch.Tensor,
                          config: dict[str, int] | None = None, y_mma_order: bool = False,
                          tail: NVFP4Tensor | None = None, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ dq(W_e).T`` with :func:`_grouped_ws_kernel`; x ``[T, K]`` bf16
    sorted by expert with each row in the K order of ``mma_k_order_rows(., 128)`` (what
    ``grouped_w4a16_into(..., x_mma_order=True)`` takes), ``weight`` stacked ``[E, N, K]``,
    ``expert_offsets`` int32 ``[E + 1]`` (not checked on the host: no sync), ``y_mma_order`` as there.
    ``config`` over :func:`default_config`; ``BLOCK_M`` defaults to the Triton kernel's token tile.
    ``tail`` (stacked ``[E, N, K2]``, the weight's ``weight_scale_2``) and ``row_scale`` (fp32 ``[T]``)
    make it the grouped W4A4 + RAC GEMM as in ``grouped_w4a16_into``: x rows then hold ``K + K2``
    values, both parts in the K order; ``out`` may then be bf16, fp16 or fp32."""
    k2 = 0 if tail is None else tail.shape[-1]
    num_experts, n, k = check_grouped_bf16_call(x[:, : x.shape[1] - k2], weight, expert_offsets, out,
                                                _OUT_DTYPES if row_scale is not None else (torch.bfloat16,))
    if y_mma_order and n % X_ORDER_BLOCK_K:
        raise ValueError(f"y_mma_order needs N % {X_ORDER_BLOCK_K} == 0 (whole K-order blocks), got N={n}")
    cfg: dict[str, Any] = {**default_config(k), "BLOCK_M": _grouped_block_m(x.shape[0], num_experts), **(config or {})}
    check_config(cfg, n, k)
    if tail is not None:
        if tuple(tail.shape) != (num_experts, n, k2) or k2 == 0:
            raise ValueError(f"the tail weight must be [{num_experts}, {n}, K2] with K2 > 0, got {tuple(tail.shape)}")
        if not _scale_ring(cfg) or k2 % cfg["BLOCK_K"]:
            raise ValueError(f"a tail runs on the scale ring: BLOCK_K 256 and K2 a multiple of it; "
                             f"got K2={k2} and {cfg} (pad the tail, or use grouped_w4a16_into's Triton kernel)")
    if row_scale is not None and (row_scale.shape != (x.shape[0],) or row_scale.dtype != torch.float32):
        raise ValueError(f"row_scale must be float32 [{x.shape[0]}], got {row_scale.dtype} {tuple(row_scale.shape)}")
    if out.numel() == 0:
        return out
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # TMA: 16-byte aligned rows
        x = x.contiguous()
    codes, scales = _operands(weight)
    stacked_scales = scales.reshape(num_experts * n, k // 16) if _scale_ring(cfg) else None
    w_desc, x_desc, s_desc = _descriptors(codes.reshape(num_experts * n, k // 8), x, stacked_scales, cfg)
    t_desc, ts_desc = w_desc, s_desc  # stand-ins the kernel does not read without a tail
    if tail is not None:
        tail_codes, tail_scales = _operands(tail)
        t_desc, _, ts_desc = _descriptors(tail_codes.reshape(num_experts * n, k2 // 8), x,
                                          tail_scales.reshape(num_experts * n, k2 // 16), cfg)
    ws2 = weight.weight_scale_2.reshape(-1).to(torch.float32)
    n_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    num_tiles = n_tiles * num_experts
    programs = min(num_tiles, cfg.get("PROGRAMS") or cfg["CTAS_PER_SM"] * _sm_count(x.device))
    # DYNAMIC: the tile counter and finished-program count, two int32 zeros every launch leaves zero
    # (the dense kernels' split-K counters: allocated before any graph capture, one buffer a device,
    # so launches of these kernels on one device must not overlap); otherwise a stand-in, not read
    scheduler = _split_counters(x.device, 2) if cfg.get("DYNAMIC") else expert_offsets
    _grouped_ws_kernel[(programs,)](
        w_desc, x_desc, s_desc, t_desc, ts_desc, scales, ws2, expert_offsets, scheduler, out,
        ws2 if row_scale is None else row_scale, n, k, k2, num_tiles, n_tiles, scales.stride(0), scales.stride(1),
        1 if ws2.numel() > 1 else 0, out.stride(0),
        **_meta(cfg, y_mma_order, n, out.shape[0] * out.stride(0), tail is not None, row_scale is not None),
        **_launch_options(cfg),
    )
    return out


def _descriptors(codes: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None,
                 cfg: dict[str, Any]) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor]:
    """The loader's TMA descriptors: stacked code words ``[E * N, K / 8]``, x ``[T, K]`` (16-byte
    aligned rows) and, with the scale ring, stacked scale bytes ``[E * N, K / 16]`` (unit stride along
    K); without it the words' descriptor stands in for the scales' (the kernel does not read it)."""
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    w_desc = TensorDescriptor(codes, list(codes.shape), [codes.stride(0), 1], [block_n, block_k // 8],
                              words_ring_layout())
    x_desc = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [block_m // 2, X_SUB_K], x_tile_layout(block_m))
    s_desc = w_desc
    if scales is not None:
        s_desc = TensorDescriptor(scales, list(scales.shape), [scales.stride(0), 1], [block_n, block_k // 16],
                                  scales_ring_layout())
    return w_desc, x_desc, s_desc


def _scale_ring(cfg: dict[str, Any]) -> bool:
    """Whether the scale bytes come through the ring (``SCALE_RING``): at ``BLOCK_K`` 256, where a
    TMA row holds 16 scale bytes (the least TMA copies); at 128 the MMA warps load them."""
    return cfg["BLOCK_K"] == 2 * X_ORDER_BLOCK_K


Y_I32_LIMIT = 2**31
"""Outputs spanning fewer elements than this are addressed with 32-bit offsets in the epilogue."""


def _meta(cfg: dict[str, Any], y_mma_order: bool, n: int, y_elements: int, has_tail: bool = False,
          row_scale: bool = False) -> dict[str, int]:
    """The kernel's compile-time arguments (``y_elements``: the span of the output's rows)."""
    return {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"], "STAGES": cfg["STAGES"],
            "NUM_WARPS": cfg["num_warps"], "LOADER_REGS": cfg["LOADER_REGS"],
            "Y_MMA_ORDER": int(y_mma_order), "EVEN_N": int(n % cfg["BLOCK_N"] == 0),
            "Y_I32": int(y_elements < Y_I32_LIMIT),
            "SCALE_RING": int(_scale_ring(cfg)), "DYNAMIC": cfg.get("DYNAMIC", 0), "HAS_TAIL": int(has_tail),
            "ROW_SCALE": int(row_scale), "WG_SPLIT": cfg.get("WG_SPLIT", 0), "MMA_REGS": cfg.get("MMA_REGS", MMA_REGS),
            "A_PIPE": cfg.get("A_PIPE", 0), "CODE_ORDER": cfg.get("CODE_ORDER", 0)}


def _launch_options(cfg: dict[str, Any]) -> dict[str, int]:
    """The launch's warps (the first MMA warpgroup only with ``WG_SPLIT``: the other is a worker
    partition) and register bound."""
    warps = cfg["num_warps"] // 2 if cfg.get("WG_SPLIT") else cfg["num_warps"]
    return {"num_warps": warps, **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {})}


def compile_for_sm90(kernel: Any, meta: dict[str, int], types: dict[str, Any], aligned: tuple[str, ...],
                     options: dict[str, int]) -> dict[str, str]:
    """Compile the Gluon ``kernel`` for sm_90 without a GPU: ``meta`` its constexprs, ``types`` the
    signature of its non-int32 arguments (pointers, descriptors: the rest are i32), ``aligned`` the
    int32 arguments the GPU launcher would specialize as divisible by 16 (pointers always are).
    Returns its ``ptx`` and ``sass`` (cuobjdump of Triton's bundled CUDA tools)."""
    import os
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {name: "constexpr" if name in meta else types.get(name, "i32") for name in kernel.arg_names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                 if signature[name].startswith("*") or (signature[name] == "i32" and name in aligned)}
    source = GluonASTSource(fn=kernel, signature=signature, attrs=divisible,
                            constexprs={(kernel.arg_names.index(name),): v for name, v in meta.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as directory:
        cubin = os.path.join(directory, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    return {"ptx": compiled.asm["ptx"], "sass": sass}


def compile_offline(cfg: dict[str, Any], n: int, k: int, y_mma_order: bool = False, k2: int = 0,
                    row_scale: bool = False) -> str:
    """Compile :func:`_grouped_ws_kernel` for sm_90 without a GPU (``cfg`` a full config, ``[E, n, k]``
    weights, a ``k2``-column tail and a row scale if given) and return its SASS."""
    from triton.runtime.jit import mangle_type

    check_config(cfg, n, k)
    w_desc, x_desc, s_desc = _descriptors(torch.empty(2 * n, k // 8, dtype=torch.int32, device="meta"),
                                          torch.empty(16, k + k2, dtype=torch.bfloat16, device="meta"),
                                          torch.empty(2 * n, k // 16, dtype=torch.uint8, device="meta")
                                          if _scale_ring(cfg) else None, cfg)
    types = {"w_desc": mangle_type(w_desc), "x_desc": mangle_type(x_desc), "s_desc": mangle_type(s_desc),
             "t_desc": mangle_type(w_desc), "ts_desc": mangle_type(s_desc), "scales_ptr": "*u8", "ws2_ptr": "*fp32",
             "offsets_ptr": "*i32", "sched_ptr": "*i32", "y_ptr": "*bf16", "row_scale_ptr": "*fp32"}
    # what the launcher specializes on the GPU: pointers, K and the strides divisible by 16
    return compile_for_sm90(_grouped_ws_kernel, _meta(cfg, y_mma_order, n, 16 * n, k2 > 0, row_scale), types,
                            ("K", "K2", "stride_se", "stride_sn", "stride_ym"), _launch_options(cfg))["sass"]
