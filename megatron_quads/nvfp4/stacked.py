"""Stacked expert weights: one :class:`NVFP4Tensor` holding every expert of an MoE projection.

Expert ``e`` of a stacked weight has codes ``[e, N, K/2]``, scales ``[e, N, K/16]`` and decode scale
``weight_scale_2[e]`` (shape ``[E]`` or ``[E, 1]``, or one value shared by all experts). Its tokens
are rows ``expert_offsets[e]:expert_offsets[e + 1]`` of an input sorted by expert.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_quads.nvfp4.backend import use_kernels
from megatron_quads.nvfp4.format import BLOCK_SIZE
from megatron_quads.nvfp4.global_scale import decode_scale_from_amax
from megatron_quads.nvfp4.quantize import quantize
from megatron_quads.nvfp4.tensor import NVFP4Tensor

_REFERENCE_CHUNK = 1 << 20  # elements the reference quantizes at once


def stack_experts(parts: Sequence[NVFP4Tensor]) -> NVFP4Tensor:
    """Per-expert ``[N, K]`` NVFP4 weights stacked to ``[E, N, K]`` with ``weight_scale_2`` ``[E]``."""
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1:
        raise ValueError(f"experts of one projection must share a shape to be grouped, got {sorted(shapes)}")
    return NVFP4Tensor(
        codes=torch.stack([p.codes for p in parts]),
        scales=torch.stack([p.scales for p in parts]),
        weight_scale_2=torch.stack([p.weight_scale_2.reshape(()) for p in parts]),
        shape=torch.Size((len(parts), *parts[0].shape)),
        dtype=parts[0].dtype,
    )


def expert_weight(weight: NVFP4Tensor, expert: int) -> NVFP4Tensor:
    """Expert ``expert``'s ``[N, K]`` weight out of a stacked ``[E, N, K]`` NVFP4 tensor."""
    ws2 = weight.weight_scale_2.reshape(-1)
    decode = ws2[expert] if ws2.numel() > 1 else ws2[0]
    return NVFP4Tensor(
        codes=weight.codes[expert],
        scales=weight.scales[expert],
        weight_scale_2=decode,
        shape=torch.Size(weight.shape[1:]),
        dtype=weight.dtype,
    )


def expert_weights(weight: NVFP4Tensor) -> list[NVFP4Tensor]:
    """Every expert's ``[N, K]`` weight out of a stacked ``[E, N, K]`` NVFP4 tensor (views; one
    ``unbind`` per field instead of an index per expert)."""
    ws2 = weight.weight_scale_2.reshape(-1)
    count = weight.shape[0]
    decodes = ws2.unbind(0) if ws2.numel() > 1 else (ws2[0],) * count
    shape = torch.Size(weight.shape[1:])
    return [NVFP4Tensor(codes=c, scales=s, weight_scale_2=d, shape=shape, dtype=weight.dtype)
            for c, s, d in zip(weight.codes.unbind(0), weight.scales.unbind(0), decodes, strict=True)]


def quantize_experts(x: torch.Tensor, amax: torch.Tensor) -> NVFP4Tensor:
    """``quantize`` of a ``[n, N, K]`` stack with one global amax per expert (``amax`` ``[n]``),
    ``weight_scale_2`` ``[n, 1]``: one Triton call on CUDA (no host-side NaN scan); the reference
    elsewhere, a few experts at a time so that its temporaries stay in cache (rows are quantized
    independently: the bytes are the same)."""
    if use_kernels(x):
        from megatron_quads.nvfp4.quantize_kernel import quantize_kernel

        return quantize_kernel(x, amax[:, None], validate=False)
    n, rows, k = x.shape
    codes = torch.empty(n, rows, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, rows, k // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=x.device)
    step = max(1, _REFERENCE_CHUNK // max(1, rows * k))
    for first in range(0, n, step):
        part = quantize(x[first : first + step], global_amax=amax[first : first + step, None])
        codes[first : first + step], scales[first : first + step] = part.codes, part.scales
    return NVFP4Tensor(codes, scales, decode_scale_from_amax(amax[:, None]), x.shape, x.dtype)


def check_grouped_shapes(x: torch.Tensor, weight: NVFP4Tensor, expert_offsets: torch.Tensor) -> None:
    """Raise a clear error unless the shapes of ``x``, the stacked ``weight`` and ``expert_offsets``
    fit together (no host synchronisation: the kernels call this too)."""
    if len(weight.shape) != 3:
        raise ValueError(f"grouped linears need a stacked [E, N, K] weight, got shape {tuple(weight.shape)}")
    num_experts, _, in_features = weight.shape
    if x.ndim != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [tokens, {in_features}], got shape {tuple(x.shape)}")
    if expert_offsets.shape != (num_experts + 1,):
        raise ValueError(f"expert_offsets must have shape [{num_experts + 1}] (E + 1), got {tuple(expert_offsets.shape)}")
