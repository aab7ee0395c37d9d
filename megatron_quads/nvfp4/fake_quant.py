"""NVFP4 fake quantization with a straight-through gradient."""

from __future__ import annotations

import torch

from megatron_quads.nvfp4.global_scale import AmaxLike
from megatron_quads.nvfp4.quantize import quantize_dequantize


class _FakeQuantSTE(torch.autograd.Function):
    """Forward ``dequantize(quantize(x))``; backward passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, global_amax: AmaxLike, block_2d: bool) -> torch.Tensor:
        return quantize_dequantize(x, global_amax=global_amax, block_2d=block_2d)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, None, None


def fake_quant(x: torch.Tensor, global_amax: AmaxLike = None, block_2d: bool = False) -> torch.Tensor:
    """NVFP4 quantize-dequantize of ``x`` in x's dtype, with a straight-through gradient."""
    if isinstance(global_amax, torch.Tensor):
        global_amax = global_amax.detach()
    return _FakeQuantSTE.apply(x, global_amax, block_2d)
