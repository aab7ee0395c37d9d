"""Grouped (MoE) NVFP4 linears over tokens sorted by expert: the reference the Triton kernels match.

An MoE layer's routed tokens are sorted by expert and expert ``e`` owns rows
``expert_offsets[e]:expert_offsets[e + 1]`` of ``x [T, K]``. Expert weights are one stacked
:class:`NVFP4Tensor` with codes ``[E, N, K/2]``, scales ``[E, N, K/16]`` and one decode scale per
expert (``weight_scale_2`` of shape ``[E]`` or ``[E, 1]``). RAC channel sets are ``[E, S]`` (the same
count for every expert: ``S = ratio * K``) with residual weights ``W_S`` stacked as ``[E, N, S]``.
"""

from __future__ import annotations

import torch

from megatron_quads.nvfp4 import NVFP4Tensor
from megatron_quads.nvfp4.stacked import check_grouped_shapes, expert_weight
from megatron_quads.nvfp4.backend import use_kernels
from megatron_quads.rollout.rac import rac_linear
from megatron_quads.rollout.w4a4 import ActivationScale, w4a16_linear


def expert_offsets_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """int32 ``[E + 1]`` row offsets of each expert's tokens from per-expert token counts ``[E]``."""
    zero = torch.zeros(1, dtype=torch.int64, device=counts.device)
    return torch.cat([zero, torch.cumsum(counts.to(torch.int64), 0)]).to(torch.int32)


def validate_grouped(x: torch.Tensor, weight: NVFP4Tensor, expert_offsets: torch.Tensor) -> None:
    """:func:`check_grouped_shapes`, and ``expert_offsets`` rising from 0 to the token count (reads them on the host)."""
    check_grouped_shapes(x, weight, expert_offsets)
    bounds = expert_offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != x.shape[0] or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"expert_offsets must rise from 0 to the token count {x.shape[0]}, got {bounds}")


def kernel_x_order(x: torch.Tensor, rows_per_expert: float, in_features: int | None = None) -> int | None:
    """The K-order block (``X_ORDER_BLOCK_K``) in which :func:`grouped_w4a16_linear` should take
    ``x [T, K]`` for the grouped W4A16 kernel, or ``None`` (natural order): the rule of
    :func:`megatron_quads.kernels.dispatch.x_order_block` (x on the kernels, bf16, enough routed rows
    per expert, K a multiple of the block). ``in_features`` is K when x is not that input itself
    (the MoE's down projection, asked with the layer's hidden states before its input exists).

    Putting the tokens' rows in that order (``mma_k_order_rows``) before the MoE gather costs one copy
    of them and saves the kernel reordering every x tile in registers."""
    from megatron_quads.kernels.dispatch import x_order_block

    return x_order_block(use_kernels(x), x.dtype, rows_per_expert, x.shape[-1] if in_features is None else in_features)


def grouped_w4a16_linear(x: torch.Tensor, weight: NVFP4Tensor, expert_offsets: torch.Tensor,
                         x_mma_order: bool = False, y_mma_order: bool = False) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ dq(W_e).T`` for every expert (weight-only NVFP4), ``[T, N]``.

    On CUDA with bf16 activations: one Triton kernel launch, no host synchronisation. ``x_mma_order``:
    x's rows are in the kernel's K order (only where :func:`kernel_x_order` gave a block);
    ``y_mma_order``: the output's rows are written in it (for an elementwise op feeding the next
    grouped GEMM in that order)."""
    if use_kernels(x) and x.dtype == torch.bfloat16:
        from megatron_quads.kernels.w4a16 import grouped_w4a16_kernel

        return grouped_w4a16_kernel(x, weight, expert_offsets, x_mma_order=x_mma_order, y_mma_order=y_mma_order)
    if x_mma_order or y_mma_order:
        raise ValueError("x or y in the kernel's K order needs the grouped W4A16 kernel (CUDA, bf16): see kernel_x_order")
    validate_grouped(x, weight, expert_offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    bounds = expert_offsets.tolist()
    for e in range(weight.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = w4a16_linear(x[lo:hi], expert_weight(weight, e))
    return out


def route_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed rows sorted by expert: ``order`` (int64 ``[R]``, a stable argsort of the flat ids
    ``[R]``, so rows of one expert keep their token order) and the experts' row offsets (int32
    ``[E + 1]``, :func:`expert_offsets_from_counts`). Ids must lie in ``[0, num_experts)``. On CUDA
    one Triton launch, no host sync (``torch.bincount`` reads the largest id on the host, which
    would stop CUDA-graph capture)."""
    if use_kernels(expert_ids) and expert_ids.dtype == torch.int64:
        from megatron_quads.kernels.moe_routing import route_by_expert_kernel

        return route_by_expert_kernel(expert_ids, num_experts)
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_ids.device)
    counts.index_add_(0, expert_ids, torch.ones_like(expert_ids))
    return order, expert_offsets_from_counts(counts)


_COMBINE_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def combine_routed_rows(y: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """The MoE combine: ``out[t] = sum of y[i] * weight`` over the routed rows ``i`` of token ``t``.

    ``y [T * top_k, H]`` holds the routed rows sorted by expert, ``order`` (int64 ``[T * top_k]``) the
    flat (token, slot) index each row came from, ``top_k_weights [T, top_k]`` the router weights.
    Each product is rounded to the promoted dtype of ``y`` and the weights, then to ``out_dtype``;
    a token's products are summed in fp32 from zero in the order of the rows (expert order) and the
    sum rounded once to ``out_dtype`` (what ``index_add_`` into a bf16 output does on the CPU). On
    CUDA one Triton launch does it in that same order (``index_add_`` there adds with atomics in no
    fixed order), so the result is deterministic and the CPU's."""
    tokens, top_k = top_k_weights.shape
    if use_kernels(y, top_k_weights) and {y.dtype, top_k_weights.dtype, out_dtype} <= set(_COMBINE_KERNEL_DTYPES):
        from megatron_quads.kernels.moe_routing import combine_routed_rows_kernel

        slot_rows = torch.empty_like(order)
        slot_rows[order] = torch.arange(order.numel(), device=order.device)
        out = torch.empty(tokens, y.shape[1], dtype=out_dtype, device=y.device)
        return combine_routed_rows_kernel(y.contiguous(), slot_rows.view(tokens, top_k), top_k_weights, out)
    terms = (y * top_k_weights.reshape(-1)[order, None]).to(out_dtype).to(torch.float32)
    sums = torch.zeros(tokens, y.shape[1], dtype=torch.float32, device=y.device)
    return sums.index_add_(0, order // top_k, terms).to(out_dtype)


def grouped_rac_linear(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    expert_offsets: torch.Tensor,
    channels: torch.Tensor | None = None,
    residual_weight: NVFP4Tensor | None = None,
    mode: ActivationScale = ActivationScale.PER_TOKEN,
    static_amax: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A4 (+ RAC when ``channels [E, S]`` and ``residual_weight [E, N, S]`` are given) per expert.

    A tail widened by :func:`prepare_grouped_rac_tail` (repeated channels over zero ``W_S``
    columns) gives the same product. On CUDA: the Triton prologue and one grouped GEMM, no host
    synchronisation."""
    if (channels is None) != (residual_weight is None):
        raise ValueError("grouped RAC needs both channels [E, S] and residual_weight [E, N, S], or neither")
    if use_kernels(x):
        from megatron_quads.kernels.w4a4 import grouped_rac_kernel

        return grouped_rac_kernel(x, weight, expert_offsets, channels, residual_weight, mode, static_amax)
    validate_grouped(x, weight, expert_offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    no_channels = torch.zeros(0, dtype=torch.int32, device=x.device)
    bounds = expert_offsets.tolist()
    for e in range(weight.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi == lo:
            continue
        if channels is None or channels.shape[1] == 0:
            out[lo:hi] = rac_linear(x[lo:hi], expert_weight(weight, e), no_channels, None, mode, static_amax)
        else:
            assert residual_weight is not None
            out[lo:hi] = rac_linear(
                x[lo:hi], expert_weight(weight, e), channels[e], expert_weight(residual_weight, e), mode, static_amax
            )
    return out


def prepare_grouped_rac_tail(channels: torch.Tensor, residual_weight: NVFP4Tensor,
                             in_features: int) -> tuple[torch.Tensor, NVFP4Tensor]:
    """The RAC tail (``channels [E, S]``, ``residual_weight [E, N, S]`` of a stacked weight with
    ``in_features`` columns) as :func:`grouped_rac_linear` should be given it on the tail's device:
    on the kernel path what :func:`~megatron_quads.kernels.w4a4.prepare_rac_tail` makes of it (on
    sm_90 maybe widened by repeated channels and zero ``W_S`` columns: the same product), elsewhere
    the inputs themselves. Called when the weights load or move, never per forward."""
    if not use_kernels(channels, residual_weight.codes):
        return channels, residual_weight
    from megatron_quads.kernels.w4a4 import prepare_rac_tail

    return prepare_rac_tail(channels, residual_weight, in_features, channels.device)
