"""W4A4 (+RAC) on sm_100 through vLLM's CUTLASS FP4 GEMM: the project quantizes, vLLM multiplies.

On a GPU with FP4 tensor cores (compute capability 10.x) and a vLLM build that has
``cutlass_scaled_fp4_mm``, the plugin runs a W4A4 linear as one block-scaled FP4 GEMM over the
augmented K: ``A = [q(x), q(r_S)]`` (the project's quantizer, per-token global scale, the residual
channels' second quantization with the same scale) against ``W_aug = [q(W), W_S]`` (prepared once
per weight load: packed codes and swizzled block scales, zero-padded along K to a multiple of 64).
The GEMM applies the weight's decode scale as its ``alpha``; the per-token activation decode scale
multiplies the output rows. Written against vLLM's API and tested on CPU with a reference GEMM in
vLLM's place; the kernel itself has not been run here (no sm_100).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_quads.nvfp4 import BLOCK_SIZE, NVFP4Tensor, quantize
from megatron_quads.nvfp4.activation import ActivationScale, activation_amax
from megatron_quads.nvfp4.swizzle import swizzle_scales

K_ALIGN = 64
"""The augmented K is padded to this (whole 4-column scale tiles; zero codes and scales add nothing)."""

Fp4Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
"""``(a_codes [M, K/2], b_codes [N, K/2], a_scales, b_scales (swizzled e4m3), alpha, out_dtype) -> [M, N]``:
vLLM's ``cutlass_scaled_fp4_mm`` contract."""


def fp4_gemm_supported(device: torch.device) -> bool:
    """Whether ``device`` has FP4 tensor cores and vLLM's CUTLASS FP4 GEMM is built."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 10:
        return False
    try:
        return hasattr(torch.ops._C, "cutlass_scaled_fp4_mm")
    except (AttributeError, RuntimeError):
        return False


def vllm_fp4_gemm() -> Fp4Gemm:
    """vLLM's CUTLASS FP4 GEMM."""
    from vllm import _custom_ops as ops

    return ops.cutlass_scaled_fp4_mm


def _padded_k(k: int) -> int:
    return -(-k // K_ALIGN) * K_ALIGN


def _pad_k(codes: torch.Tensor, scales: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[R, k/2]`` and linear scales ``[R, k/16]`` zero-padded to :data:`K_ALIGN`."""
    extra = _padded_k(k) - k
    if not extra:
        return codes, scales
    zeros_codes = torch.zeros(codes.shape[0], extra // 2, dtype=codes.dtype, device=codes.device)
    zeros_scales = torch.zeros(scales.shape[0], extra // BLOCK_SIZE, dtype=torch.uint8, device=scales.device)
    return torch.cat([codes, zeros_codes], 1), torch.cat([scales.view(torch.uint8), zeros_scales], 1).view(scales.dtype)


@dataclass(frozen=True)
class AugmentedWeight:
    """``W_aug = [q(W), W_S]`` as the FP4 GEMM takes it: packed codes ``[N, Kp/2]``, swizzled block
    scales, the decode scale ``alpha`` and the RAC channels (``None``: plain W4A4)."""

    codes: torch.Tensor
    scales: torch.Tensor
    alpha: torch.Tensor
    in_features: int
    channels: torch.Tensor | None

    @classmethod
    def prepare(cls, weight: NVFP4Tensor, channels: torch.Tensor | None = None,
                residual: NVFP4Tensor | None = None) -> AugmentedWeight:
        """The GEMM's weight operand of a ``[N, K]`` NVFP4 weight and its RAC tail (built once)."""
        codes, scales, k = weight.codes, weight.scales, weight.shape[-1]
        if channels is not None and channels.numel():
            if residual is None:
                raise ValueError("RAC channels are set but the residual weight W_S is missing")
            codes, scales = torch.cat([codes, residual.codes], -1), torch.cat([scales.view(torch.uint8), residual.scales.view(torch.uint8)], -1).view(scales.dtype)
            k += channels.numel()
        else:
            channels = None
        codes, scales = _pad_k(codes.contiguous(), scales.contiguous(), k)
        return cls(codes, swizzle_scales(scales), weight.weight_scale_2.reshape(()).to(torch.float32), weight.shape[-1], channels)


def augmented_activation(x: torch.Tensor, channels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``A = [q(x), q(r_S)]`` of ``x [T, K]`` as packed codes ``[T, Kp/2]``, linear block scales
    ``[T, Kp/16]`` and the per-token decode scale ``[T]`` (both parts share it), by the project's quantizer."""
    amax = activation_amax(x, ActivationScale.PER_TOKEN)
    xq = quantize(x, global_amax=amax)
    codes, scales, k = xq.codes, xq.scales, x.shape[-1]
    if channels is not None:
        residual = x.to(torch.float32) - xq.dequantize(torch.float32)
        rq = quantize(residual.index_select(-1, channels.to(device=x.device, dtype=torch.long)), global_amax=amax)
        codes = torch.cat([codes, rq.codes], -1)
        scales = torch.cat([scales.view(torch.uint8), rq.scales.view(torch.uint8)], -1).view(scales.dtype)
        k += channels.numel()
    codes, scales = _pad_k(codes, scales, k)
    return codes, scales, xq.weight_scale_2.reshape(-1)


def fp4_linear(x: torch.Tensor, weight: AugmentedWeight, gemm: Fp4Gemm | None = None) -> torch.Tensor:
    """W4A4 (+RAC) ``x [..., K] -> [..., N]`` as one FP4 GEMM over the augmented K, in x's dtype."""
    gemm = gemm or vllm_fp4_gemm()
    x2 = x.reshape(-1, weight.in_features)
    n = weight.codes.shape[0]
    if not x2.shape[0]:
        return x.new_zeros((*x.shape[:-1], n))
    codes, scales, decode = augmented_activation(x2, weight.channels)
    out = gemm(codes, weight.codes, swizzle_scales(scales), weight.scales, weight.alpha, torch.bfloat16)
    return (out.float() * decode[:, None]).to(x.dtype).reshape(*x.shape[:-1], n)
