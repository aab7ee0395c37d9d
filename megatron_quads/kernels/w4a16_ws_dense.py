"""Dense decode W4A16 on the warp-specialized kernel's pipeline: split-K over persistent programs.

The dense Triton kernel (:func:`~megatron_quads.kernels.w4a16.w4a16_linear_into`) loads,
dequantizes and multiplies in the same warps and reorders x in registers every K step; at 8192^2 and
M = 16 it sits at FP8 parity (docs/kernels.md). The grouped warp-specialized kernel
(:mod:`~megatron_quads.kernels.w4a16_ws`) does the same products with a loader warp streaming
code words, scale bytes and x (already in the MMA K order) by TMA into a shared-memory ring and
register-A wgmma in the MMA warps; timed as a split-K dense GEMM (``benchmarks/diag_ws_dense.py``,
splits posed as experts, partials not summed) it took 16.0 against 19.9 us. This module is that
GEMM for real:

* tiles are (N tile, K split, token tile) triples, split fastest, taken ``p, p + P, ...`` by
  ``CTAS_PER_SM`` persistent programs an SM; split ``s`` covers the ring steps ``[s q, (s + 1) q)``
  of ``BLOCK_K`` (256) columns, ``q = cdiv(K / BLOCK_K, SPLIT_K)`` (the split count is lowered until
  no split is empty);
* the loader (:func:`_load_partition`) puts each step's words ``[BN, BK/8]`` and scale bytes
  ``[BN, BK/16]`` into the ring by TMA; x's ``[BM, 64]`` tiles come by TMA too when the caller
  passes x in the kernel's K order, else the x warps (:func:`_x_partition`) read natural x and store
  it in that order; the MMA warps run the grouped kernel's K loop
  (:func:`~megatron_quads.kernels.w4a16_ws._k_loop`) over the split;
* without split-K the epilogue stores ``acc * weight_scale_2``; with it each split stores its fp32
  partial, and the last split of an output tile to arrive (a gpu-scope counter, left at zero) sums
  the partials in split order, so the result does not depend on timing: the Triton dense kernel's
  scheme, and its bits where the split boundaries coincide.

The wgmma needs x in the K order of ``mma_k_order_rows(x, 128)``: :func:`w4a16_ws_linear_into`
takes it so (``x_mma_order``) or reorders it (the x warps, or a copy kernel for 32- and 64-row
tiles). Needs ``K % 256 == 0`` and bf16 x and output. Dispatched by ``w4a16_linear_into`` on sm_90
up to 16 rows (docs/kernels.md has the measurements).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megatron_quads.kernels import w4a16 as _triton_w4a16
from megatron_quads.kernels.w4a16 import (
    X_ORDER_BLOCK_K,
    _check_out,
    _check_weight_parts,
    _operands,
    _sm_count,
    _split_counters,
    mma_k_order_rows,
)
from megatron_quads.kernels.w4a16_ws import (
    X_SUB_K,
    Y_I32_LIMIT,
    _k_loop,
    _launch_options,
    _store_rows,
    compile_for_sm90,
    runs_on,
    scales_ring_layout,
    wgmma_layout,
    words_ring_layout,
    x_tile_layout,
)
from megatron_quads.nvfp4.tensor import NVFP4Tensor

_X_SUB_K = gl.constexpr(X_SUB_K)
_LOAD_X = gl.constexpr(True)
"""False only in a timing probe (``benchmarks/diag_ws_dense_floor.py``): the loader then skips the x
tiles, and the results are garbage."""


@gluon.jit
def _tile_coordinates(tile, n_tiles, SPLIT_K: gl.constexpr):
    """``(output tile, split, N tile, token tile)`` of ``tile`` (split fastest, then N, then tokens)."""
    out_tile = tile // SPLIT_K
    return out_tile, tile % SPLIT_K, out_tile % n_tiles, out_tile // n_tiles


@gluon.jit
def _split_range(split, k_steps, SPLIT_K: gl.constexpr):
    """Ring steps ``[lo, hi)`` of ``split`` (``k_steps`` in all; the caller keeps every split non-empty)."""
    per_split = gl.cdiv(k_steps, SPLIT_K)
    lo = split * per_split
    return lo, gl.minimum(lo + per_split, k_steps)


@gluon.jit
def _load_partition(w_desc, x_desc, s_desc, ring_w, ring_x, ring_s, ready, empty, num_tiles, n_tiles, k_steps,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                    SPLIT_K: gl.constexpr, X_NATURAL: gl.constexpr):
    """The loader warp: each of the program's tiles' ring steps (words, scale bytes and, unless
    ``X_NATURAL``, x tiles) by TMA."""
    SUB: gl.constexpr = BLOCK_K // _X_SUB_K
    X_BYTES: gl.constexpr = 0 if (X_NATURAL or not _LOAD_X) else SUB * x_desc.block_type.nbytes
    BYTES: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes + X_BYTES
    step = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        _, split, n_tile, m_tile = _tile_coordinates(tile, n_tiles, SPLIT_K)
        kt_lo, kt_hi = _split_range(split, k_steps, SPLIT_K)
        row0 = n_tile * BLOCK_N
        m0 = m_tile * BLOCK_M
        for kt in range(kt_lo, kt_hi):
            stage = step % STAGES
            # a fresh mbarrier counts as having completed the phase before 0: the first lap waits on nothing
            mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, BYTES)  # rows past N or M are zero-filled and counted
            tma.async_copy_global_to_shared(w_desc, [row0, kt * (BLOCK_K // 8)], bar, ring_w.index(stage))
            tma.async_copy_global_to_shared(s_desc, [row0, kt * (BLOCK_K // 16)], bar, ring_s.index(stage))
            if not X_NATURAL and _LOAD_X:
                for j in gl.static_range(SUB):
                    tma.async_copy_global_to_shared(x_desc, [m0, kt * BLOCK_K + j * _X_SUB_K], bar,
                                                    ring_x.index(stage * SUB + j))
            step += 1


X_ROWS = 16
"""Token rows the x warps move at a time (their registers hold ``16 x 64`` values a tile)."""
_X_ROWS = gl.constexpr(X_ROWS)


@gluon.constexpr_function
def x_load_layout(x_warps: int) -> gl.BlockedLayout:
    """The natural-order x values of one ring x tile's 16 rows, ``[16, 4, 2, 8]`` (row, ``t``,
    ``i % 2``, 8 consecutive columns): 16 bytes a thread, the warps over rows."""
    return gl.BlockedLayout(size_per_thread=[1, 1, 1, 8], threads_per_warp=[4, 4, 2, 1],
                            warps_per_cta=[x_warps, 1, 1, 1], order=[3, 2, 1, 0])


@gluon.jit
def _x_tile_pointers(x_ptr, rows, stride_xm, LOAD: gl.constexpr):
    """Pointers to ring x tile 0's natural-order columns ``[16, 4, 2, 8]`` for token ``rows``: in a
    256-wide step, tile ``j`` holds the natural columns ``128 (j // 2) + 16 (j % 2) + 32 t + 8 i + v``
    (``t < 4``, ``i < 2``, ``v < 8``: the K order of ``mma_k_order_rows(x, 128)``); add the step's
    and the tile's column offset."""
    COLS: gl.constexpr = gl.SliceLayout(0, LOAD)  # [t, i, v]
    t = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, COLS)))
    i = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, COLS)))
    v = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, COLS)))
    cols = (32 * t)[:, None, None] + (8 * i)[None, :, None] + v[None, None, :]
    row_ptrs = x_ptr + rows.to(gl.int64) * stride_xm
    return row_ptrs[:, None, None, None] + cols[None, :, :, :]


@gluon.jit
def _k_order_tile(values):
    """One x tile's values ``[16, 4 (t), 2 (i), 8 (4 h + 2 q1 + q0)]`` in its K order, ``[16, 64]``:
    column ``32 i + 16 q1 + 8 q0 + 2 t + h`` (a renaming of register and lane bits; no data moves
    until the store)."""
    v = gl.reshape(values, [_X_ROWS, 4, 2, 2, 2, 2])  # [m, t, i, h, q1, q0]
    return gl.reshape(gl.permute(v, [0, 2, 4, 5, 1, 3]), [_X_ROWS, _X_SUB_K])


@gluon.jit
def _x_partition(x_ptr, ring_x, ready, empty, M, stride_xm, num_tiles, n_tiles, k_steps,
                 BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr,
                 X_WARPS: gl.constexpr):
    """The x warps (``X_NATURAL``): each ring step's x ``[BM, 256]`` read from global memory in
    natural order, 16 rows of the four x tiles at a time, and stored into the stage's x tiles in the
    K order (the first 16 rows' loads issued before the stage is free, so their latency overlaps the
    wait), then the stage's second ``ready`` arrival. Rows past M are stored as zeros. ``BLOCK_K``
    is 256: four ``[BM, 64]`` x tiles a step."""
    LOAD: gl.constexpr = x_load_layout(X_WARPS)
    SUB: gl.constexpr = BLOCK_K // _X_SUB_K
    rows0 = gl.arange(0, _X_ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LOAD))))
    step = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        _, split, _, m_tile = _tile_coordinates(tile, n_tiles, SPLIT_K)
        kt_lo, kt_hi = _split_range(split, k_steps, SPLIT_K)
        for kt in range(kt_lo, kt_hi):
            stage = step % STAGES
            for c in gl.static_range(BLOCK_M // _X_ROWS):
                rows = m_tile * BLOCK_M + c * _X_ROWS + rows0
                ptrs = _x_tile_pointers(x_ptr + kt * BLOCK_K, rows, stride_xm, LOAD)
                mask = (rows < M)[:, None, None, None]
                # the step's four tiles' loads in flight together (one L2 round trip, not four)
                v0 = gl.load(ptrs, mask=mask, other=0.0)
                v1 = gl.load(ptrs + 16, mask=mask, other=0.0)
                v2 = gl.load(ptrs + 128, mask=mask, other=0.0)
                v3 = gl.load(ptrs + 144, mask=mask, other=0.0)
                if c == 0:
                    mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
                ring_x.index(stage * SUB).slice(c * _X_ROWS, _X_ROWS).store(_k_order_tile(v0))
                ring_x.index(stage * SUB + 1).slice(c * _X_ROWS, _X_ROWS).store(_k_order_tile(v1))
                ring_x.index(stage * SUB + 2).slice(c * _X_ROWS, _X_ROWS).store(_k_order_tile(v2))
                ring_x.index(stage * SUB + 3).slice(c * _X_ROWS, _X_ROWS).store(_k_order_tile(v3))
            fence_async_shared()  # the generic-proxy stores before the wgmma's async-proxy reads
            mbarrier.arrive(ready.index(stage), count=1)
            step += 1


@gluon.jit
def _store_partial(acc, partials_ptr, counters_ptr, out_tile, split, SPLIT_K: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Store this split's fp32 partial of ``out_tile`` and count its arrival: ``(last, total)``, where
    ``last`` says this program arrived last, and then ``total`` is the sum of the tile's partials in
    split order (and its counter is back at zero)."""
    MMA: gl.constexpr = wgmma_layout(acc.shape[1], NUM_WARPS)
    TILE: gl.constexpr = acc.shape[0] * acc.shape[1]
    local = (gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, MMA))[:, None] * acc.shape[1]
             + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, MMA))[None, :])
    base = partials_ptr + out_tile.to(gl.int64) * (SPLIT_K * TILE)
    gl.store(base + split * TILE + local, acc)
    gl.thread_barrier()  # every thread's partial is stored before one thread's gpu-scope release
    arrived = gl.atomic_add(counters_ptr + out_tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    total = acc
    if last:
        total = gl.zeros(acc.shape, gl.float32, layout=MMA)
        for s in gl.static_range(SPLIT_K):  # fixed order: the result does not depend on timing
            total += gl.load(base + s * TILE + local, cache_modifier=".cg")
        gl.atomic_xchg(counters_ptr + out_tile, 0, sem="relaxed", scope="gpu")
    return last, total


@gluon.jit
def _mma_partition(ring_w, ring_x, ring_s, ready, empty, ws2_ptr, y_ptr, partials_ptr, counters_ptr, M, N,
                   num_tiles, n_tiles, k_steps, stride_ym,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                   NUM_WARPS: gl.constexpr, SPLIT_K: gl.constexpr, EVEN_N: gl.constexpr, Y_I32: gl.constexpr):
    """The MMA warps: each tile's split of K through the grouped kernel's K loop, then its store (or
    its partial, and the tile's sum by the last split)."""
    weight_scale_2 = gl.load(ws2_ptr)
    step = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        out_tile, split, n_tile, m_tile = _tile_coordinates(tile, n_tiles, SPLIT_K)
        kt_lo, kt_hi = _split_range(split, k_steps, SPLIT_K)
        acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=wgmma_layout(BLOCK_M, NUM_WARPS))
        # the scale bytes come through the ring (SCALE_RING): the pointer argument is not read
        acc, step = _k_loop(acc, ring_w, ring_x, ring_s, ready, empty, ws2_ptr, step, kt_hi - kt_lo, BLOCK_K, STAGES,
                            NUM_WARPS, True)
        if SPLIT_K == 1:
            _store_rows(acc, y_ptr, weight_scale_2, ws2_ptr, n_tile * BLOCK_N, N, m_tile * BLOCK_M, M, stride_ym,
                        NUM_WARPS, False, EVEN_N, Y_I32, False)
        else:
            last, total = _store_partial(acc, partials_ptr, counters_ptr, out_tile, split, SPLIT_K, NUM_WARPS)
            if last:
                _store_rows(total, y_ptr, weight_scale_2, ws2_ptr, n_tile * BLOCK_N, N, m_tile * BLOCK_M, M,
                            stride_ym, NUM_WARPS, False, EVEN_N, Y_I32, False)


@gluon.jit
def _dense_ws_kernel(
    w_desc, x_desc, s_desc, x_ptr, ws2_ptr, y_ptr, partials_ptr, counters_ptr, M, N, num_tiles, n_tiles, k_steps,
    stride_xm, stride_ym,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    NUM_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, SPLIT_K: gl.constexpr, EVEN_N: gl.constexpr,
    Y_I32: gl.constexpr, X_NATURAL: gl.constexpr, X_WARPS: gl.constexpr,
    X_REGS: gl.constexpr,
):
    """Persistent: program ``p`` takes tiles ``p, p + P, ...`` of ``num_tiles`` (N tiles x splits x
    token tiles); ``w_desc`` / ``s_desc`` over the ``[N, K / 8]`` words and ``[N, K / 16]`` scale
    bytes, ``x_desc`` over x ``[M, K]`` in the K order; with ``X_NATURAL`` the x warps read x
    (``x_ptr``, natural order) and reorder it instead, each stage then completing on two arrivals."""
    ring_w = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], words_ring_layout())
    ring_x = gl.allocate_shared_memory(gl.bfloat16, [STAGES * (BLOCK_K // _X_SUB_K), BLOCK_M, _X_SUB_K],
                                       x_tile_layout(BLOCK_M))
    ring_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_K // 16], scales_ring_layout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=2 if X_NATURAL else 1)
        mbarrier.init(empty.index(j), count=1)
    # two calls rather than one with a partition list built by condition: the jit frontend cannot
    # bind a (function, arguments) tuple to a name
    if X_NATURAL:
        gl.warp_specialize([
            (_mma_partition, (ring_w, ring_x, ring_s, ready, empty, ws2_ptr, y_ptr, partials_ptr, counters_ptr, M, N,
                              num_tiles, n_tiles, k_steps, stride_ym, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, NUM_WARPS,
                              SPLIT_K, EVEN_N, Y_I32)),
            (_load_partition, (w_desc, x_desc, s_desc, ring_w, ring_x, ring_s, ready, empty, num_tiles, n_tiles,
                               k_steps, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, SPLIT_K, X_NATURAL)),
            (_x_partition, (x_ptr, ring_x, ready, empty, M, stride_xm, num_tiles, n_tiles, k_steps, BLOCK_M, BLOCK_K,
                            STAGES, SPLIT_K, X_WARPS)),
        ], [1, X_WARPS], [LOADER_REGS, X_REGS])
    else:
        gl.warp_specialize([
            (_mma_partition, (ring_w, ring_x, ring_s, ready, empty, ws2_ptr, y_ptr, partials_ptr, counters_ptr, M, N,
                              num_tiles, n_tiles, k_steps, stride_ym, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, NUM_WARPS,
                              SPLIT_K, EVEN_N, Y_I32)),
            (_load_partition, (w_desc, x_desc, s_desc, ring_w, ring_x, ring_s, ready, empty, num_tiles, n_tiles,
                               k_steps, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, SPLIT_K, X_NATURAL)),
        ], [1], [LOADER_REGS])


DEFAULT_CONFIG = {"BLOCK_N": 128, "BLOCK_K": 256, "STAGES": 3, "num_warps": 8, "LOADER_REGS": 40, "CTAS_PER_SM": 2,
                  "maxnreg": 80, "X_WARPS": 2, "X_REGS": 80}
"""``BLOCK_M`` (16, 32 or 64) defaults to the smallest that holds M (at most 64), ``SPLIT_K`` to
:func:`default_split`; :data:`DECODE_CONFIG` or :data:`WIDE_M_CONFIG` goes over this by ``BLOCK_M``.
``num_warps`` must be ``BLOCK_N / 16`` (a warpgroup a 64 weight rows); ``X_WARPS`` warps
(``X_REGS`` registers each) reorder natural-order x inside the kernel (0: a copy kernel,
``mma_k_order_rows``, reorders it before the launch)."""

DECODE_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "CTAS_PER_SM": 3}
"""For ``BLOCK_M`` 16: one MMA warpgroup, three CTAs an SM. H200, 2026-11-30 16:49 run (x reordered by
the x warps): 8192^2 at M = 16 18.96 us against 19.22 with two warpgroups, 4096^2 8.73 against 10.25."""

WIDE_M_CONFIG = {"X_WARPS": 0}
"""For ``BLOCK_M`` 32 and 64 (``STAGES`` 2 at 64: 50 KB a stage; by default as many tiles as SMs): x
reordered by a copy kernel, as the x warps move 16 rows of the four tiles at a time (H200, 16:55 run,
8192^2: M = 32 24.0 us against 24.5 with the x warps, M = 64 32.0 against 40.2; with half the splits,
one tile an SM, 21.9 and 27.8)."""

BLOCK_K = 2 * X_ORDER_BLOCK_K
"""The ring step: two 128-blocks of x's K order, and 16 scale bytes a row (TMA rows need 16 bytes)."""

def default_block_m(m: int) -> int:
    """Tokens per tile: the smallest of 16, 32, 64 holding ``m`` (64 above that: several token tiles)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def split_count(k_steps: int, split_k: int) -> int:
    """The split count actually run: ``split_k`` lowered until every split has a step
    (``cdiv(k_steps, cdiv(k_steps, split_k))``)."""
    return triton.cdiv(k_steps, triton.cdiv(k_steps, max(1, min(split_k, k_steps))))


def default_split(out_tiles: int, k_steps: int, programs: int) -> int:
    """The largest power-of-two split count (at most 16) whose tiles fit in one wave of ``programs``
    and that gives every split the same number of steps; 1 if none does."""
    split = 1
    while split < 16 and out_tiles * split * 2 <= programs and k_steps % (split * 2) == 0:
        split *= 2
    return split


def check_config(cfg: dict[str, Any], n: int, k: int) -> None:
    """Raise unless ``cfg`` tiles an ``[N, K]`` weight the way :func:`_dense_ws_kernel` needs."""
    if k % BLOCK_K:
        raise ValueError(f"the warp-specialized dense kernel needs K % {BLOCK_K} == 0 (its ring step), got K={k}; "
                         "use w4a16_linear_into's Triton kernel")
    if cfg["BLOCK_K"] != BLOCK_K:
        raise ValueError(f"BLOCK_K must be {BLOCK_K} (the scale bytes' TMA rows), got {cfg['BLOCK_K']}")
    if cfg["BLOCK_N"] not in (64, 128, 256) or cfg["num_warps"] != cfg["BLOCK_N"] // 16:
        raise ValueError(f"BLOCK_N must be 64, 128 or 256 with num_warps = BLOCK_N / 16, got {cfg}")
    if cfg["BLOCK_M"] not in (16, 32, 64) or cfg["STAGES"] not in range(2, 9) or cfg["SPLIT_K"] < 1:
        raise ValueError(f"BLOCK_M must be 16, 32 or 64, STAGES 2..8 and SPLIT_K >= 1, got {cfg}")
    stage_bytes = cfg["BLOCK_N"] * BLOCK_K // 2 + cfg["BLOCK_M"] * BLOCK_K * 2 + cfg["BLOCK_N"] * BLOCK_K // 16
    if cfg["STAGES"] * stage_bytes > 200 * 1024:
        raise ValueError(f"{cfg['STAGES']} ring stages of {stage_bytes} bytes do not fit in shared memory; lower "
                         "STAGES, BLOCK_N or BLOCK_M")


def supports(x: torch.Tensor, weight: NVFP4Tensor) -> bool:
    """Whether :func:`w4a16_ws_linear_into` can run this call: bf16 x on an sm_90 GPU, an ``[N, K]``
    weight with ``K % 256 == 0``."""
    return (x.dtype == torch.bfloat16 and len(weight.shape) == 2 and weight.shape[1] % BLOCK_K == 0
            and runs_on(x.device))


def resolve_config(m: int, n: int, k: int, device: torch.device, config: dict[str, Any] | None) -> dict[str, Any]:
    """``config`` over :data:`DEFAULT_CONFIG` with ``BLOCK_M`` and ``SPLIT_K`` filled in and checked
    (``SPLIT_K`` as run: :func:`split_count`)."""
    block_m = (config or {}).get("BLOCK_M") or default_block_m(m)
    cfg: dict[str, Any] = {**DEFAULT_CONFIG, **(DECODE_CONFIG if block_m == 16 else WIDE_M_CONFIG),
                           **({"STAGES": 2} if block_m == 64 else {}), **(config or {}), "BLOCK_M": block_m}
    k_steps = k // BLOCK_K if k % BLOCK_K == 0 else 1
    out_tiles = triton.cdiv(n, cfg["BLOCK_N"]) * triton.cdiv(max(m, 1), cfg["BLOCK_M"])
    if cfg.get("SPLIT_K") is None:  # wider token tiles: one tile an SM (their K loop weighs more than the split)
        waves = cfg["CTAS_PER_SM"] if block_m == 16 else 1
        cfg["SPLIT_K"] = default_split(out_tiles, k_steps, waves * _sm_count(device))
    check_config(cfg, n, k)
    cfg["SPLIT_K"] = split_count(k_steps, cfg["SPLIT_K"])
    return cfg


def _descriptors(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor | None,
                 cfg: dict[str, Any]) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the words ``[N, K / 8]``, the scale bytes ``[N, K / 16]`` and x ``[M, K]``
    (without x, the words' descriptor stands in for it: the kernel then does not read it)."""
    block_n = cfg["BLOCK_N"]
    w_desc = TensorDescriptor(codes, list(codes.shape), [codes.stride(0), 1], [block_n, BLOCK_K // 8],
                              words_ring_layout())
    s_desc = TensorDescriptor(scales, list(scales.shape), [scales.stride(0), 1], [block_n, BLOCK_K // 16],
                              scales_ring_layout())
    if x is None:
        return w_desc, s_desc, w_desc
    x_desc = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [cfg["BLOCK_M"], X_SUB_K],
                              x_tile_layout(cfg["BLOCK_M"]))
    return w_desc, s_desc, x_desc


def _meta(cfg: dict[str, Any], n: int, y_elements: int, x_natural: bool) -> dict[str, int]:
    return {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": BLOCK_K, "STAGES": cfg["STAGES"],
            "NUM_WARPS": cfg["num_warps"], "LOADER_REGS": cfg["LOADER_REGS"], "SPLIT_K": cfg["SPLIT_K"],
            "EVEN_N": int(n % cfg["BLOCK_N"] == 0), "Y_I32": int(y_elements < Y_I32_LIMIT),
            "X_NATURAL": int(x_natural), "X_WARPS": cfg["X_WARPS"] or 1,
            "X_REGS": cfg["X_REGS"]}


def w4a16_ws_linear_into(x: torch.Tensor, weight: NVFP4Tensor, out: torch.Tensor,
                         config: dict[str, Any] | None = None, x_mma_order: bool = False) -> torch.Tensor:
    """``out [M, N] = x [M, K] @ dq(W).T`` (bf16) with :func:`_dense_ws_kernel`.

    ``x_mma_order``: x is already in the K order of ``mma_k_order_rows(x, 128)`` (else the kernel's x
    warps reorder it, or with ``X_WARPS`` 0 a copy kernel before the launch). ``config`` over
    :data:`DEFAULT_CONFIG`: ``BLOCK_M``, ``BLOCK_N``, ``STAGES``, ``SPLIT_K``, ``CTAS_PER_SM`` (or
    ``PROGRAMS``), ``X_WARPS``, ``maxnreg``.
    """
    if len(weight.shape) != 2:
        raise ValueError(f"w4a16_ws_linear_into needs an [N, K] weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    _check_weight_parts(x, weight, k)
    if x.ndim != 2:
        raise ValueError(f"x must be [M, {k}], got shape {tuple(x.shape)}")
    m = x.shape[0]
    _check_out(out, (m, n), (torch.bfloat16,), x.device)
    cfg = resolve_config(m, n, k, x.device, config)
    if m == 0:
        return out
    x_natural = not x_mma_order and cfg["X_WARPS"] > 0  # the kernel reorders x
    if not x_mma_order and not x_natural:
        x = mma_k_order_rows(x, X_ORDER_BLOCK_K)
    if x.stride(1) != 1 or (not x_natural and (x.stride(0) % 8 or x.data_ptr() % 16)):  # TMA: 16-byte aligned rows
        x = x.contiguous()
    codes, scales = _operands(weight)
    w_desc, s_desc, x_desc = _descriptors(codes, scales, None if x_natural else x, cfg)
    split = cfg["SPLIT_K"]
    n_tiles, m_tiles = triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"])
    num_tiles = n_tiles * m_tiles * split
    programs = min(num_tiles, cfg.get("PROGRAMS") or cfg["CTAS_PER_SM"] * _sm_count(x.device))
    tile_elements = cfg["BLOCK_N"] * cfg["BLOCK_M"]
    # looked up in the Triton module: the tests poison the workspace there, for every kernel
    partials = _triton_w4a16._new_partials(split * n_tiles * m_tiles * tile_elements if split > 1 else 1, x.device)
    counters = _split_counters(x.device, n_tiles * m_tiles)
    ws2 = weight.weight_scale_2.reshape(1).to(torch.float32)
    _dense_ws_kernel[(programs,)](
        w_desc, x_desc, s_desc, x, ws2, out, partials, counters, m, n, num_tiles, n_tiles, k // BLOCK_K, x.stride(0),
        out.stride(0), **_meta(cfg, n, m * out.stride(0), x_natural), **_launch_options(cfg),
    )
    return out


def compile_offline(cfg: dict[str, Any], n: int, k: int, m: int = 16, x_mma_order: bool = False) -> dict[str, str]:
    """Compile :func:`_dense_ws_kernel` for sm_90 without a GPU (``cfg`` as :func:`resolve_config`
    returns it) and return its ``ptx`` and ``sass``."""
    from triton.runtime.jit import mangle_type

    check_config(cfg, n, k)
    x_natural = not x_mma_order and cfg["X_WARPS"] > 0
    w_desc, s_desc, x_desc = _descriptors(torch.empty(n, k // 8, dtype=torch.int32, device="meta"),
                                          torch.empty(n, k // 16, dtype=torch.uint8, device="meta"),
                                          None if x_natural else torch.empty(m, k, dtype=torch.bfloat16, device="meta"),
                                          cfg)
    types = {"w_desc": mangle_type(w_desc), "x_desc": mangle_type(x_desc), "s_desc": mangle_type(s_desc),
             "x_ptr": "*bf16", "ws2_ptr": "*fp32", "y_ptr": "*bf16", "partials_ptr": "*fp32", "counters_ptr": "*i32"}
    return compile_for_sm90(_dense_ws_kernel, _meta(cfg, n, m * n, x_natural), types, ("stride_xm", "stride_ym"),
                            _launch_options(cfg))
