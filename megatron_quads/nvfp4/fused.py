"""Fake quantization without the packed intermediate: the trainer's hot path.

:func:`fake_quant_values` computes exactly ``dequantize(quantize(x, global_amax))`` (bit for bit;
tests hold it to the reference, on CPU and CUDA) but never packs codes and never validates, so it
has no host synchronisation and about ten elementwise passes. On CUDA the Triton fake-quant kernel
(:func:`megatron_quads.nvfp4.quantize_kernel.fake_quant_kernel`) computes the same bits in one launch.
``torch.compile`` is not used here: Inductor's Triton code is not bit-exact with the reference.
"""

from __future__ import annotations

import torch

from megatron_quads.nvfp4.format import (
    BLOCK_SIZE,
    FLOAT32_MAX,
    FP4_MAX,
    FP8_E4M3_MAX,
    GLOBAL_SCALE_DIVISOR,
    e2m1_lut,
    magnitude_index,
)
from megatron_quads.nvfp4.backend import use_kernels
from megatron_quads.nvfp4.global_scale import decode_scale_from_amax


def _round_to_e2m1_values(v: torch.Tensor) -> torch.Tensor:
    """Nearest-even E2M1 value (fp32) of already-scaled ``v``, saturating at +-6, sign kept."""
    q = e2m1_lut(v.device)[:8][magnitude_index(v).long()]
    # negative values keep their sign, values rounding to zero included (code 8 is -0); -0.0 stays +0
    return torch.where(v < 0, -q, q)


def _fake_quant_math(x: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """The arithmetic of quantize + dequantize, in the reference's operation order (1x16 blocks)."""
    blocks = x.unflatten(-1, (-1, BLOCK_SIZE))
    amax = global_amax.to(torch.float32)
    amax = amax.reshape(amax.shape + (1, 1))
    # a true division: ``2688 / tensor`` would be ``reciprocal(tensor) * 2688``, rounded twice
    encode = torch.clamp(torch.div(torch.full_like(amax, GLOBAL_SCALE_DIVISOR), amax), max=FLOAT32_MAX)
    encode = torch.where(encode == 0, torch.ones_like(encode), encode)
    decode = 1.0 / encode
    block_amax = blocks.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = block_amax * (encode * torch.reciprocal(torch.full_like(encode, FP4_MAX)))
    scale = torch.clamp(scale, min=-FP8_E4M3_MAX, max=FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    element_encode = torch.clamp(1.0 / (scale * decode), max=FLOAT32_MAX)
    values = _round_to_e2m1_values(blocks.to(torch.float32) * element_encode)
    weight_scale_2 = decode_scale_from_amax(amax)
    return ((values * scale) * weight_scale_2).flatten(-2).to(x.dtype)


def fake_quant_values(x: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """``dequantize(quantize(x, global_amax=global_amax))`` for finite ``x``, 1x16 blocks, no checks.

    ``global_amax`` is fp32, a scalar or one value per leading index (broadcast against
    ``x.shape[:-1]``). Inputs are not validated: pass finite values whose last dim is a multiple of 16.
    """
    if use_kernels(x):  # one Triton kernel, same bits (tests/test_kernels_quantize.py)
        from megatron_quads.nvfp4.quantize_kernel import fake_quant_kernel

        return fake_quant_kernel(x, global_amax)
    return _fake_quant_math(x, global_amax)
