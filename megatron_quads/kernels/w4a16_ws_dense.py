"""Dense decode W4A16 on the warp-specialized kernel's pipeline: split-K over persistent programs.

The dense Triton kernel (:func:`~megatron_quads.kernels.w4a16.w4a16_linear_into`) loads,
dequantizes and multiplies in the same warps and reorders x in registers every K step. This kernel
does the same products the way the grouped warp-specialized kernel (:mod:`~megatron_quads.kernels.w4a16_ws`)
does, a loader warp streaming the weights by TMA into a shared-memory ring and register-A wgmma in
the MMA warps:

* tiles are (N tile, K split, token tile) triples, split fastest, taken ``p, p + P, ...`` by
  ``CTAS_PER_SM`` persistent programs an SM; split ``s`` covers the ring steps ``[s q, (s + 1) q)``
  of ``BLOCK_K`` (256) columns, ``q = cdiv(K / BLOCK_K, SPLIT_K)`` (the split count is lowered until
  no split is empty);
* the loader (:func:`_load_partition`) puts each step's words ``[BN, BK/8]`` and scale bytes
  ``[BN, BK/16]`` into the ring by TMA; the x warps (:func:`_x_partition`) read natural-order x and
  store its ``[16, 64]`` tiles in the MMA K order of ``mma_k_order_rows(x, 128)``; the MMA warps run
  the grouped kernel's K loop (:func:`~megatron_quads.kernels.w4a16_ws._k_loop`) over the split;
* without split-K the epilogue stores ``acc * weight_scale_2``; with it each split stores its fp32
  partial, and the last split of an output tile to arrive (a gpu-scope counter, left at zero) sums
  the partials in split order, so the result does not depend on timing: the Triton dense kernel's
  scheme, and its bits where the split boundaries coincide.

Token tiles of 16 rows (:data:`BLOCK_M`); needs ``K % 256 == 0`` and bf16 x and output. Which calls
run here is :mod:`~megatron_quads.kernels.dispatch`'s rule (sm_90, up to 16 rows).
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
from megatron_quads.kernels.dispatch import X_ORDER_BLOCK_K
from megatron_quads.kernels.w4a16 import (
    _check_out,
    _check_weight_parts,
    _operands,
    _sm_count,
    _split_counters,
)
from megatron_quads.kernels.w4a16_ws import (
    X_SUB_K,
    Y_I32_LIMIT,
    _k_loop,
    _launch_options,
    _store_rows,
    compile_for_sm90,
    scales_ring_layout,
    wgmma_layout,
    words_ring_layout,
    x_tile_layout,
)
from megatron_quads.nvfp4.tensor import NVFP4Tensor

_X_SUB_K = gl.constexpr(X_SUB_K)


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
def _load_partition(w_desc, s_desc, ring_w, ring_s, ready, empty, num_tiles, n_tiles, k_steps,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr):
    """The loader warp: each of the program's tiles' ring steps (code words and scale bytes) by TMA;
    the x warps (:func:`_x_partition`) fill the same stages' x tiles."""
    BYTES: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes
    step = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        _, split, n_tile, m_tile = _tile_coordinates(tile, n_tiles, SPLIT_K)
        kt_lo, kt_hi = _split_range(split, k_steps, SPLIT_K)
        row0 = n_tile * BLOCK_N
        for kt in range(kt_lo, kt_hi):
            stage = step % STAGES
            # a fresh mbarrier counts as having completed the phase before 0: the first lap waits on nothing
            mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, BYTES)  # rows past N are zero-filled and counted
            tma.async_copy_global_to_shared(w_desc, [row0, kt * (BLOCK_K // 8)], bar, ring_w.index(stage))
            tma.async_copy_global_to_shared(s_desc, [row0, kt * (BLOCK_K // 16)], bar, ring_s.index(stage))
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
    """The x warps: each ring step's x ``[BM, 256]`` read from global memory in
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
    w_desc, s_desc, x_ptr, ws2_ptr, y_ptr, partials_ptr, counters_ptr, M, N, num_tiles, n_tiles, k_steps,
    stride_xm, stride_ym,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    NUM_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, SPLIT_K: gl.constexpr, EVEN_N: gl.constexpr,
    Y_I32: gl.constexpr, X_WARPS: gl.constexpr, X_REGS: gl.constexpr,
):
    """Persistent: program ``p`` takes tiles ``p, p + P, ...`` of ``num_tiles`` (N tiles x splits x
    token tiles); ``w_desc`` / ``s_desc`` over the ``[N, K / 8]`` words and ``[N, K / 16]`` scale
    bytes; the x warps read x (``x_ptr``, natural order) and reorder it, each stage completing on two
    arrivals (the loader's TMA bytes and the x warps' stores)."""
    ring_w = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], words_ring_layout())
    ring_x = gl.allocate_shared_memory(gl.bfloat16, [STAGES * (BLOCK_K // _X_SUB_K), BLOCK_M, _X_SUB_K],
                                       x_tile_layout(BLOCK_M))
    ring_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_K // 16], scales_ring_layout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=2)
        mbarrier.init(empty.index(j), count=1)
    gl.warp_specialize([
        (_mma_partition, (ring_w, ring_x, ring_s, ready, empty, ws2_ptr, y_ptr, partials_ptr, counters_ptr, M, N,
                          num_tiles, n_tiles, k_steps, stride_ym, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, NUM_WARPS,
                          SPLIT_K, EVEN_N, Y_I32)),
        (_load_partition, (w_desc, s_desc, ring_w, ring_s, ready, empty, num_tiles, n_tiles, k_steps, BLOCK_N,
                           BLOCK_K, STAGES, SPLIT_K)),
        (_x_partition, (x_ptr, ring_x, ready, empty, M, stride_xm, num_tiles, n_tiles, k_steps, BLOCK_M, BLOCK_K,
                        STAGES, SPLIT_K, X_WARPS)),
    ], [1, X_WARPS], [LOADER_REGS, X_REGS])


BLOCK_M = 16
"""The token tile: the dense dispatch sends at most 16 rows here (more rows run several tiles)."""

BLOCK_K = 2 * X_ORDER_BLOCK_K
"""The ring step: two 128-blocks of x's K order, and 16 scale bytes a row (TMA rows need 16 bytes)."""

DEFAULT_CONFIG = {"BLOCK_N": 64, "BLOCK_K": BLOCK_K, "STAGES": 3, "num_warps": 4, "LOADER_REGS": 40,
                  "CTAS_PER_SM": 3, "maxnreg": 80, "X_WARPS": 2, "X_REGS": 80}
"""One MMA warpgroup (``num_warps`` must be ``BLOCK_N / 16``: a warpgroup a 64 weight rows), three
CTAs an SM; ``SPLIT_K`` defaults to :func:`default_split`; ``X_WARPS`` warps (1, 2 or 4, ``X_REGS``
registers each) reorder natural-order x inside the kernel. ``benchmarks/bench_kernels.py --only
w4a16_ws_dense`` times it against the Triton kernel and cuBLAS (docs/kernels.md)."""


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
    if cfg["BLOCK_M"] != BLOCK_M or cfg["STAGES"] not in range(2, 9) or cfg["SPLIT_K"] < 1:
        raise ValueError(f"BLOCK_M must be {BLOCK_M}, STAGES 2..8 and SPLIT_K >= 1, got {cfg}")
    if cfg["X_WARPS"] not in (1, 2, 4):
        raise ValueError(f"X_WARPS must be 1, 2 or 4 (warps over the 16 rows of an x tile), got {cfg}")
    stage_bytes = cfg["BLOCK_N"] * BLOCK_K // 2 + cfg["BLOCK_M"] * BLOCK_K * 2 + cfg["BLOCK_N"] * BLOCK_K // 16
    if cfg["STAGES"] * stage_bytes > 200 * 1024:
        raise ValueError(f"{cfg['STAGES']} ring stages of {stage_bytes} bytes do not fit in shared memory; lower "
                         "STAGES, BLOCK_N or BLOCK_M")


def resolve_config(m: int, n: int, k: int, device: torch.device, config: dict[str, Any] | None) -> dict[str, Any]:
    """``config`` over :data:`DEFAULT_CONFIG` with ``BLOCK_M`` and ``SPLIT_K`` filled in and checked
    (``SPLIT_K`` as run: :func:`split_count`)."""
    cfg: dict[str, Any] = {**DEFAULT_CONFIG, "BLOCK_M": BLOCK_M, **(config or {})}
    k_steps = k // BLOCK_K if k % BLOCK_K == 0 else 1
    out_tiles = triton.cdiv(n, cfg["BLOCK_N"]) * triton.cdiv(max(m, 1), cfg["BLOCK_M"])
    if cfg.get("SPLIT_K") is None:
        cfg["SPLIT_K"] = default_split(out_tiles, k_steps, cfg["CTAS_PER_SM"] * _sm_count(device))
    check_config(cfg, n, k)
    cfg["SPLIT_K"] = split_count(k_steps, cfg["SPLIT_K"])
    return cfg


def _descriptors(codes: torch.Tensor, scales: torch.Tensor,
                 cfg: dict[str, Any]) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the words ``[N, K / 8]`` and the scale bytes ``[N, K / 16]``."""
    block_n = cfg["BLOCK_N"]
    w_desc = TensorDescriptor(codes, list(codes.shape), [codes.stride(0), 1], [block_n, BLOCK_K // 8],
                              words_ring_layout())
    s_desc = TensorDescriptor(scales, list(scales.shape), [scales.stride(0), 1], [block_n, BLOCK_K // 16],
                              scales_ring_layout())
    return w_desc, s_desc


def _meta(cfg: dict[str, Any], n: int, y_elements: int) -> dict[str, int]:
    return {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": BLOCK_K, "STAGES": cfg["STAGES"],
            "NUM_WARPS": cfg["num_warps"], "LOADER_REGS": cfg["LOADER_REGS"], "SPLIT_K": cfg["SPLIT_K"],
            "EVEN_N": int(n % cfg["BLOCK_N"] == 0), "Y_I32": int(y_elements < Y_I32_LIMIT),
            "X_WARPS": cfg["X_WARPS"], "X_REGS": cfg["X_REGS"]}


def w4a16_ws_linear_into(x: torch.Tensor, weight: NVFP4Tensor, out: torch.Tensor,
                         config: dict[str, Any] | None = None) -> torch.Tensor:
    """``out [M, N] = x [M, K] @ dq(W).T`` (bf16, x in its natural K order) with :func:`_dense_ws_kernel`.

    ``config`` over :data:`DEFAULT_CONFIG`: ``BLOCK_N``, ``STAGES``, ``SPLIT_K``, ``CTAS_PER_SM`` (or
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
    if x.stride(1) != 1:
        x = x.contiguous()
    codes, scales = _operands(weight)
    w_desc, s_desc = _descriptors(codes, scales, cfg)
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
        w_desc, s_desc, x, ws2, out, partials, counters, m, n, num_tiles, n_tiles, k // BLOCK_K, x.stride(0),
        out.stride(0), **_meta(cfg, n, m * out.stride(0)), **_launch_options(cfg),
    )
    return out


def compile_offline(cfg: dict[str, Any], n: int, k: int, m: int = 16) -> dict[str, str]:
    """Compile :func:`_dense_ws_kernel` for sm_90 without a GPU (``cfg`` as :func:`resolve_config`
    returns it) and return its ``ptx`` and ``sass``."""
    from triton.runtime.jit import mangle_type

    check_config(cfg, n, k)
    w_desc, s_desc = _descriptors(torch.empty(n, k // 8, dtype=torch.int32, device="meta"),
                                  torch.empty(n, k // 16, dtype=torch.uint8, device="meta"), cfg)
    types = {"w_desc": mangle_type(w_desc), "s_desc": mangle_type(s_desc), "x_ptr": "*bf16", "ws2_ptr": "*fp32",
             "y_ptr": "*bf16", "partials_ptr": "*fp32", "counters_ptr": "*i32"}
    return compile_for_sm90(_dense_ws_kernel, _meta(cfg, n, m * n), types, ("stride_xm", "stride_ym"),
                            _launch_options(cfg))
