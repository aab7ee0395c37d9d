"""Reference NVFP4 quantize in plain PyTorch (CPU and CUDA); decoding is :func:`~megatron_quads.nvfp4.tensor.dequantize`.

The arithmetic follows Transformer Engine's NVFP4 quantizer operation for operation, so codes and
scale bytes are identical to TE's for every input, rounding ties included (tests/test_nvfp4_golden.py
checks this against vectors produced by TE's own reference). See docs/nvfp4.md for the formulas.
"""

from __future__ import annotations

import torch

from megatron_quads.nvfp4.backend import use_kernels
from megatron_quads.nvfp4.format import (
    BLOCK_SIZE,
    FLOAT32_MAX,
    FP4_MAX,
    FP8_E4M3_MAX,
    pack_codes,
    round_to_e2m1_codes,
)
from megatron_quads.nvfp4.global_scale import (
    AmaxLike,
    decode_scale_from_amax,
    global_amax_tensor,
    global_encode_scale,
)
from megatron_quads.nvfp4.tensor import NVFP4Tensor, dequantize
from megatron_quads.nvfp4.validation import validate_input


def _tile_amax_2d(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """amax over 16x16 tiles, repeated to every row of its tile: ``[..., M, K/16]`` fp32."""
    rows = x.shape[-2]
    pad_rows = (-rows) % block_size
    padded = torch.nn.functional.pad(x.abs(), (0, 0, 0, pad_rows))  # zeros never raise an amax
    tiles = padded.unflatten(-2, (-1, block_size)).unflatten(-1, (-1, block_size))
    tile_amax = tiles.amax(dim=(-3, -1))  # [..., M/16, K/16]
    return tile_amax.repeat_interleave(block_size, dim=-2)[..., :rows, :].to(torch.float32)


def quantize(
    x: torch.Tensor,
    block_size: int = BLOCK_SIZE,
    global_amax: AmaxLike = None,
    block_2d: bool = False,
) -> NVFP4Tensor:
    """Quantize ``x`` to NVFP4 (1x16 blocks along the last dim, or 16x16 tiles with ``block_2d``).

    ``global_amax`` overrides the per-tensor amax, so several tensors can share one global scale (an
    expert's gate and up projections must); it may also hold one amax per leading index, e.g. per
    token, broadcastable against ``x.shape[:-1]``.
    """
    if use_kernels(x) and block_size == BLOCK_SIZE:  # the Triton kernel: same bytes (tests/test_kernels_quantize.py)
        from megatron_quads.nvfp4.quantize_kernel import quantize_kernel

        return quantize_kernel(x, global_amax, block_2d)
    validate_input(x, block_size, block_2d)
    amax = global_amax_tensor(global_amax, x)
    blocks = x.unflatten(-1, (-1, block_size))  # [..., K/16, 16]

    if block_2d:
        block_amax = _tile_amax_2d(x, block_size).unsqueeze(-1)
    else:
        block_amax = blocks.abs().amax(dim=-1, keepdim=True).to(torch.float32)

    encode = global_encode_scale(amax)
    encode_b = encode.reshape(encode.shape + (1, 1))  # broadcast over [K/16, 16]
    decode_b = torch.div(1.0, encode_b)
    # Operation order mirrors TE: (S_enc * (1/6)) * block_amax, clamp, round to e4m3 (nearest even).
    block_scale_f32 = block_amax * (encode_b * torch.reciprocal(torch.tensor(FP4_MAX, dtype=torch.float32, device=x.device)))
    block_scale = torch.clamp(block_scale_f32, min=-FP8_E4M3_MAX, max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    # Element encode scale is a reciprocal that is then multiplied in (not a division of x).
    element_encode = torch.clamp(torch.div(1.0, block_scale.to(torch.float32) * decode_b), max=FLOAT32_MAX)
    scaled = blocks.to(torch.float32) * element_encode
    codes = round_to_e2m1_codes(scaled).flatten(-2)

    return NVFP4Tensor(
        codes=pack_codes(codes),
        scales=block_scale.squeeze(-1),
        weight_scale_2=decode_scale_from_amax(amax),
        shape=x.shape,
        dtype=x.dtype,
        global_amax=amax,
        block_2d=block_2d,
    )


def quantize_dequantize(
    x: torch.Tensor, global_amax: AmaxLike = None, block_2d: bool = False
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in x's dtype, without autograd."""
    return dequantize(quantize(x, global_amax=global_amax, block_2d=block_2d), x.dtype)
