"""MoE routing on CUDA: the routed rows sorted by expert, and each token's weighted expert outputs
summed back, both without a host sync and bit for bit the PyTorch reference.

Routing (:func:`megatron_quads.rollout.grouped.route_by_expert` is the definition): a stable sort of
the ``T * top_k`` expert ids and the experts' row offsets. One program per expert counts the ids
below its own and ranks its own rows in input order (a block cumsum), where ``torch.argsort`` sorts
the 64-bit keys in one thread block.

Combine (:func:`megatron_quads.rollout.grouped.combine_routed_rows` is the definition): ``y * weight``
rounded to the promoted dtype and then to the output's, summed in fp32 from zero in the order of
the rows (expert order), rounded once to the output dtype. On CUDA ``index_add_`` adds with atomics
in no fixed order; this kernel reads a token's ``top_k`` rows in that order instead, so it is
deterministic and bit for bit the CPU result. One program per (token, hidden block): the weighting,
the casts and the sum happen in registers, ``y`` is read once and ``out`` written once.
``benchmarks/bench_kernels.py --only moe_layer`` times both in the engine's MoE layer
(docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_quads.nvfp4.triton_codec import round_f32_to

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _combine_kernel(
    y_ptr, slot_rows_ptr, weights_ptr, out_ptr, H, stride_y, stride_out,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_H: tl.constexpr, PRODUCT_DTYPE: tl.constexpr,
):
    """Grid ``(T, cdiv(H, BLOCK_H))``: ``out[t, block] = round(sum_r round(y[row_r, block] * w_r))``
    over token ``t``'s slots ranked by their row (``SLOTS``: ``TOP_K`` rounded up to a power of two)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live_h = offs_h < H
    slot = tl.arange(0, SLOTS)
    live_slot = slot < TOP_K
    rows = tl.load(slot_rows_ptr + t * TOP_K + slot, mask=live_slot, other=1 << 62)
    weights = tl.load(weights_ptr + t * TOP_K + slot, mask=live_slot, other=0.0).to(tl.float32)
    rank = tl.sum((rows[None, :] < rows[:, None]).to(tl.int32), axis=1)  # rows are distinct
    OUT_DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for r in tl.static_range(TOP_K):
        pick = rank == r
        row = tl.sum(tl.where(pick, rows, 0), axis=0)
        weight = tl.sum(tl.where(pick, weights, 0.0), axis=0)
        values = tl.load(y_ptr + row * stride_y + offs_h, mask=live_h, other=0.0).to(tl.float32)
        term = round_f32_to(round_f32_to(values * weight, PRODUCT_DTYPE).to(tl.float32), OUT_DTYPE)
        acc += term.to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs_h, round_f32_to(acc, OUT_DTYPE), mask=live_h)


@triton.jit
def _route_kernel(ids_ptr, order_ptr, offsets_ptr, R, BLOCK: tl.constexpr):
    """Program ``e``: ``offsets[e]`` = the ids below ``e``; its rows go to ``order[offsets[e] + rank]``
    with ``rank`` their place among the ids equal to ``e`` in input order (a stable sort)."""
    e = tl.program_id(0)
    below = 0
    for start in range(0, R, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < R, other=-1)
        below += tl.sum(((ids < e) & (offs < R)).to(tl.int32), axis=0)
    tl.store(offsets_ptr + e, below.to(tl.int32))
    if e == tl.num_programs(0) - 1:
        tl.store(offsets_ptr + e + 1, R)
    placed = below
    for start in range(0, R, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mine = tl.load(ids_ptr + offs, mask=offs < R, other=-1) == e
        rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
        tl.store(order_ptr + placed + rank, offs.to(tl.int64), mask=mine)
        placed += tl.sum(mine.to(tl.int32), axis=0)


def route_by_expert_kernel(expert_ids: torch.Tensor, num_experts: int, order: torch.Tensor | None = None,
                           offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, offsets)`` of :func:`megatron_quads.rollout.grouped.route_by_expert` for int64 ids on
    CUDA: ``order`` int64 ``[R]`` (a stable sort by id), ``offsets`` int32 ``[E + 1]``, written into
    the given tensors if any. Ids must lie in ``[0, num_experts)`` (not checked: that would read them
    on the host)."""
    if expert_ids.dtype != torch.int64 or expert_ids.ndim != 1:
        raise ValueError(f"expert_ids must be a 1-D int64 tensor, got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    ids = expert_ids.contiguous()
    order = torch.empty_like(ids) if order is None else order
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=ids.device) if offsets is None else offsets
    if order.shape != ids.shape or order.dtype != torch.int64 or not order.is_contiguous():
        raise ValueError(f"order must be a contiguous int64 tensor of shape {tuple(ids.shape)}, got {order.dtype} {tuple(order.shape)}")
    if offsets.shape != (num_experts + 1,) or offsets.dtype != torch.int32 or not offsets.is_contiguous():
        raise ValueError(f"offsets must be a contiguous int32 tensor of shape [{num_experts + 1}], got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    block = min(4096, triton.next_power_of_2(max(ids.numel(), 16)))
    _route_kernel[(num_experts,)](ids, order, offsets, ids.numel(), BLOCK=block, num_warps=4)
    return order, offsets


def combine_routed_rows_kernel(y: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor,
                               out: torch.Tensor) -> torch.Tensor:
    """Write the combine into ``out [T, H]`` and return it (see the module docstring).

    ``y [R, H]`` the routed rows' outputs, ``slot_rows`` int64 ``[T, top_k]`` the row of ``y`` each
    (token, slot) went to (distinct), ``weights [T, top_k]`` the router weights. No host sync."""
    tokens, top_k = slot_rows.shape
    for name, dtype in (("y", y.dtype), ("weights", weights.dtype), ("out", out.dtype)):
        if dtype not in _TL_DTYPES:
            raise TypeError(f"{name} must be bfloat16, float16 or float32, got {dtype}")
    if weights.shape != slot_rows.shape or out.shape != (tokens, y.shape[1]) or slot_rows.dtype != torch.int64:
        raise ValueError(f"need slot_rows int64 [T, top_k], weights [T, top_k] and out [T, {y.shape[1]}]; got "
                         f"{slot_rows.dtype} {tuple(slot_rows.shape)}, {tuple(weights.shape)}, {tuple(out.shape)}")
    if out.numel() == 0:
        return out
    if y.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("y and out need contiguous rows")
    product = torch.promote_types(y.dtype, weights.dtype)
    block_h = min(1024, triton.next_power_of_2(y.shape[1]))
    grid = (tokens, triton.cdiv(y.shape[1], block_h))
    _combine_kernel[grid](y, slot_rows.contiguous(), weights.contiguous(), out, y.shape[1], y.stride(0), out.stride(0),
                          TOP_K=top_k, SLOTS=triton.next_power_of_2(top_k), BLOCK_H=block_h,
                          PRODUCT_DTYPE=_TL_DTYPES[product], num_warps=4,
                          enable_fp_fusion=False)  # a multiply-add contracted to an FMA would skip the product's rounding
    return out
