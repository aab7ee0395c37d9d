"""W4A4 NVFP4 GEMM reference: online activation quantization and an emulated FP4 GEMM.

An FP4 tensor-core GEMM multiplies ``(e2m1 * e4m3 scale)`` operands, whose products are exact, sums
them with fp32 accumulation and applies the two global decode scales (``alpha``) in the epilogue.
:func:`nvfp4_gemm` computes the same thing in PyTorch on any device, so the built-in rollout
engine, the vLLM plugin's emulation path and the analysis tools share one definition of W4A4.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_quads.nvfp4 import (
    BLOCK_SIZE,
    NVFP4Tensor,
    codes_to_values,
    quantize,
    unpack_codes,
)
from megatron_quads.nvfp4.activation import ActivationScale, activation_amax
from megatron_quads.nvfp4.backend import use_kernels


def block_values(t: NVFP4Tensor) -> torch.Tensor:
    """The exact fp32 operand an FP4 GEMM multiplies: ``e2m1 * e4m3 scale`` (no global scale)."""
    values = codes_to_values(unpack_codes(t.codes)).unflatten(-1, (-1, BLOCK_SIZE))
    return (values * t.scales.to(torch.float32).unsqueeze(-1)).flatten(-2)


def nvfp4_gemm(
    a_values: torch.Tensor,
    a_decode: torch.Tensor,
    w_values: torch.Tensor,
    w_decode: torch.Tensor,
    out_dtype: torch.dtype,
    accumulate_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(a_values @ w_values.T) * a_decode * w_decode`` with the accumulation in ``accumulate_dtype``.

    ``a_values [T, K]`` and ``w_values [N, K]`` are :func:`block_values` (exact products of codes and
    block scales); ``a_decode`` is the activations' ``weight_scale_2`` (``[T]`` per token or a
    scalar), ``w_decode`` the weight's. With float64 accumulation every product and partial sum of
    FP4 operands is exact, which makes results independent of summation order.
    """
    acc = a_values.to(accumulate_dtype) @ w_values.to(accumulate_dtype).t()
    a_scale = a_decode.to(torch.float32)
    if a_scale.ndim:
        a_scale = a_scale.unsqueeze(-1)
    alpha = a_scale * w_decode.to(torch.float32)  # the GEMM epilogue's scale, fp32
    return (acc.to(torch.float32) * alpha).to(out_dtype)


def apply_to_tokens(
    x: torch.Tensor, out_features: int, fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``fn`` on ``x`` flattened to ``[tokens, K]``, reshaped back to ``[..., out_features]``.

    An input without tokens (an expert nothing was routed to) gives an empty output without calling ``fn``.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_zeros(*lead, out_features)
    return fn(x2).reshape(*lead, out_features)


def w4a4_linear(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    mode: ActivationScale = ActivationScale.PER_TOKEN,
    static_amax: float | torch.Tensor | None = None,
    accumulate_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``y = q(x) @ q(W).T``: activations quantized online to NVFP4, output in ``x.dtype``.

    On CUDA this runs the Triton kernel (fp32 accumulation; ``accumulate_dtype`` applies to the
    PyTorch path only)."""
    if use_kernels(x) and accumulate_dtype == torch.float32:
        from megatron_quads.kernels.w4a4 import rac_linear_kernel

        return rac_linear_kernel(x, weight, None, None, mode, static_amax)

    def gemm(x2: torch.Tensor) -> torch.Tensor:
        xq = quantize(x2, global_amax=activation_amax(x2, mode, static_amax))
        return nvfp4_gemm(block_values(xq), xq.weight_scale_2, block_values(weight), weight.weight_scale_2, x.dtype, accumulate_dtype)

    return apply_to_tokens(x, weight.shape[0], gemm)


def w4a16_linear(x: torch.Tensor, weight: NVFP4Tensor) -> torch.Tensor:
    """``y = x @ dq(q(W)).T`` in fp32 (weight-only NVFP4), output in ``x.dtype``.

    On CUDA with bf16 activations this runs the Triton kernel (the same products, summed in
    another order)."""
    if use_kernels(x) and x.dtype == torch.bfloat16:
        from megatron_quads.kernels.w4a16 import w4a16_linear_kernel

        return w4a16_linear_kernel(x, weight)
    w = weight.dequantize(torch.float32)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)
