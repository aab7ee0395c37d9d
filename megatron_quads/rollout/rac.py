"""Residual Activation Compensation (RAC): a second NVFP4 pass over the worst input channels.

For a linear ``y = x W^T`` served in W4A4, the activation's quantization residual
``r = x - dequantize(quantize(x))`` is what drives the rollout-vs-trainer gap once the weights are
aligned (AQAT). RAC picks a set S of input channels (a fixed fraction of K, a multiple of 16),
quantizes ``r[:, S]`` to NVFP4 a second time, and appends it to the activation along the reduction
dimension, with the matching columns of the quantized weight appended to the weight:

    y = [q(x), q(r_S)] @ [q(W), W_S]^T        (one W4A4 GEMM over K + |S|)

Both activation parts share the activation's global scale and both weight parts the weight's, so
the GEMM has one ``alpha`` (per token with per-token activation scales), as a real FP4 kernel needs.

``W_S`` are the columns S of the same quantized weight the trainer's fake quant produces, gathered
in ascending channel order and re-blocked into 1x16 NVFP4 blocks along the gathered dimension with
the weight's global scale (:func:`megatron_quads.nvfp4.reblock.reblock_columns`). Whole aligned
blocks of 16 are copied exactly (so S = all channels gives W_S = q(W) byte for byte); other gathered
columns share a new block scale, which rounds some of them (docs/format.md quantifies it; it only
touches the small residual term).
"""

from __future__ import annotations

from enum import Enum

import torch

from megatron_quads.nvfp4 import BLOCK_SIZE, NVFP4Tensor, quantize
from megatron_quads.nvfp4.backend import use_kernels
from megatron_quads.rollout.quantized_linear import as_residual_channels
from megatron_quads.rollout.w4a4 import (
    ActivationScale,
    activation_amax,
    apply_to_tokens,
    block_values,
    nvfp4_gemm,
)

DEFAULT_RATIO = 0.125
"""Default fraction of input channels given a residual pass (12.5%: ~12.5% more FLOPs and bytes)."""


class ChannelStatistic(str, Enum):
    """How input channels are ranked for RAC (calibrated per linear, per expert for MoE)."""

    OUTPUT_ERROR = "output_error"
    """``E[r_k^2] * ||W[:, k]||^2``: channel k's expected share of the output error energy
    ``E||r W^T||^2`` (cross terms dropped). The default: it ranks by what RAC removes from y."""
    RESIDUAL_ENERGY = "residual_energy"
    """``E[r_k^2]``: the channel's activation quantization error, blind to the weight."""
    ACTIVATION_MAGNITUDE = "activation_magnitude"
    """``E[|x_k|]``: large channels first (ARCQuant-style outlier selection); no quantizer needed."""


def num_residual_channels(in_features: int, ratio: float) -> int:
    """``ratio * K`` rounded to a multiple of 16 (the NVFP4 block), clamped to ``[0, K]``."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"RAC ratio must be in [0, 1], got {ratio}")
    return min(in_features, int(round(ratio * in_features / BLOCK_SIZE)) * BLOCK_SIZE)


def select_channels(scores: torch.Tensor, ratio: float = DEFAULT_RATIO) -> torch.Tensor:
    """The top ``ratio * K`` channels by score (ties: lower index), sorted ascending, int32."""
    count = num_residual_channels(scores.numel(), ratio)
    # stable descending order: equal scores keep index order, so selection is deterministic
    order = torch.sort(scores.to(torch.float64), descending=True, stable=True).indices[:count]
    return torch.sort(order).values.to(torch.int32)


def validate_channels(channels: torch.Tensor, in_features: int) -> None:
    """Raise a clear error unless ``channels`` is a valid residual channel set for K = in_features."""
    as_residual_channels(channels, in_features)


def rac_operands(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    channels: torch.Tensor,
    residual_weight: NVFP4Tensor | None,
    mode: ActivationScale = ActivationScale.PER_TOKEN,
    static_amax: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The augmented GEMM's operands for ``x [T, K]``: ``(A [T, K+|S|], a_decode, W_aug [N, K+|S|])``.

    ``A = [q(x), q(r_S)]`` as exact FP4 block values, both parts quantized with the activation's
    global amax; ``W_aug = [q(W), W_S]``. With no channels this is plain W4A4.
    """
    amax = activation_amax(x, mode, static_amax)
    xq = quantize(x, global_amax=amax)
    a_values, w_values = block_values(xq), block_values(weight)
    if channels.numel():
        if residual_weight is None:
            raise ValueError("RAC channels are set but the residual weight W_S is missing")
        residual = x.to(torch.float32) - xq.dequantize(torch.float32)
        residual_s = residual.index_select(-1, channels.to(torch.long).to(x.device))
        rq = quantize(residual_s, global_amax=amax)  # same global scale: one GEMM alpha
        a_values = torch.cat([a_values, block_values(rq)], dim=-1)
        w_values = torch.cat([w_values, block_values(residual_weight)], dim=-1)
    return a_values, xq.weight_scale_2, w_values


def rac_linear(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    channels: torch.Tensor,
    residual_weight: NVFP4Tensor | None,
    mode: ActivationScale = ActivationScale.PER_TOKEN,
    static_amax: float | torch.Tensor | None = None,
    accumulate_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W4A4 linear with Residual Activation Compensation, as one augmented-K GEMM; output in x.dtype.

    On CUDA this runs the Triton kernels (fused activation prologue + one GEMM over K + |S|)."""
    if use_kernels(x) and accumulate_dtype == torch.float32:
        from megatron_quads.kernels.w4a4 import rac_linear_kernel

        return rac_linear_kernel(x, weight, channels, residual_weight, mode, static_amax)

    def gemm(x2: torch.Tensor) -> torch.Tensor:
        a_values, a_decode, w_values = rac_operands(x2, weight, channels, residual_weight, mode, static_amax)
        return nvfp4_gemm(a_values, a_decode, w_values, weight.weight_scale_2, x.dtype, accumulate_dtype)

    return apply_to_tokens(x, weight.shape[0], gemm)
