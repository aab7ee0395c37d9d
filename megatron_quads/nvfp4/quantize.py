"""Reference NVFP4 quantize / dequantize in plain PyTorch (CPU and CUDA).

The arithmetic follows Transformer Engine's NVFP4 quantizer operation for operation, so codes and
scale bytes are identical to TE's for every input, rounding ties included (tests/test_nvfp4_golden.py
checks this against vectors produced by TE's own reference). See docs/nvfp4.md for the formulas.
"""

from __future__ import annotations

import torch

from megatron_quads.nvfp4.format import (
    BLOCK_SIZE,
    FLOAT32_MAX,
    FP4_MAX,
    FP8_E4M3_MAX,
    GLOBAL_SCALE_DIVISOR,
    SUPPORTED_DTYPES,
    codes_to_values,
    pack_codes,
    round_to_e2m1_codes,
    unpack_codes,
)
from megatron_quads.nvfp4.backend import use_kernels
from megatron_quads.nvfp4.tensor import NVFP4Tensor

AmaxLike = float | torch.Tensor | None


def _shape_str(x: torch.Tensor) -> str:
    return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"


def validate_input(x: torch.Tensor, block_size: int = BLOCK_SIZE, block_2d: bool = False) -> None:
    """Raise a clear error if ``x`` cannot be quantized to NVFP4."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"NVFP4 quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"NVFP4 quantize got a {_shape_str(x)}; supported dtypes are bfloat16, float16 and "
            "float32: cast the tensor first"
        )
    if block_size != BLOCK_SIZE:
        raise ValueError(f"NVFP4 uses blocks of {BLOCK_SIZE} elements; block_size={block_size} is not supported")
    if x.ndim == 0 or x.shape[-1] % block_size:
        raise ValueError(
            f"NVFP4 quantize got a {_shape_str(x)}: the last dimension must be a non-zero multiple of "
            f"the block size {block_size}; pad it or quantize a reshaped view"
        )
    if block_2d and x.ndim < 2:
        raise ValueError(f"2D (16x16) block scaling needs at least 2 dimensions, got a {_shape_str(x)}")
    if x.numel() and not bool(torch.isfinite(x).all()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise ValueError(
            f"NVFP4 quantize got a {_shape_str(x)} with {n_nan} NaN and {n_inf} Inf values; "
            "NVFP4 has no encoding for them: find where they come from upstream"
        )


def compute_global_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor amax, fp32 0-dim: ``max(|x|)`` over every element."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().amax().to(torch.float32)


def _as_amax_tensor(global_amax: AmaxLike, x: torch.Tensor) -> torch.Tensor:
    if global_amax is None:
        return compute_global_amax(x)
    amax = torch.as_tensor(global_amax, dtype=torch.float32, device=x.device)
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise ValueError(f"global_amax must be finite and >= 0, got {amax} for a {_shape_str(x)}")
    try:
        torch.broadcast_shapes(amax.shape, x.shape[:-1])
    except RuntimeError as err:
        raise ValueError(
            f"global_amax of shape {tuple(amax.shape)} does not broadcast against the leading dims "
            f"{tuple(x.shape[:-1])} of a {_shape_str(x)}: pass a scalar, or one amax per leading index"
        ) from err
    return amax


def global_encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = 2688 / amax`` in fp32, capped at FLT_MAX (so amax 0 gives FLT_MAX); 1 where it is 0.

    As in TE, only a zero quotient (amax = inf, which validation rejects) falls back to 1; a zero
    amax gives FLT_MAX, harmless because every block scale and code of such a tensor is 0.
    """
    divisor = torch.tensor(GLOBAL_SCALE_DIVISOR, dtype=torch.float32, device=global_amax.device)
    encode = torch.clamp(torch.div(divisor, global_amax), max=FLOAT32_MAX)
    return torch.where(encode == 0, torch.ones_like(encode), encode)


def decode_scale_from_amax(global_amax: torch.Tensor) -> torch.Tensor:
    """``weight_scale_2 = amax / 2688`` in fp32 (the per-tensor decode scale stored in checkpoints).

    A tensor divisor on purpose: CUDA turns division by a Python scalar into multiplication by its
    rounded reciprocal, which rounds differently from the true quotient that CPU computes.
    """
    amax = global_amax.to(torch.float32)
    return torch.div(amax, torch.full_like(amax, GLOBAL_SCALE_DIVISOR))


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
    amax = _as_amax_tensor(global_amax, x)
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


def dequantize(t: NVFP4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize: ``dtype((e2m1 * e4m3_scale) * weight_scale_2)``.

    ``e2m1 * e4m3_scale`` is exact in fp32, so the only roundings are the product with the fp32
    decode scale and the final cast: the value an FP4 GEMM with fp32 accumulation multiplies with.
    """
    out_dtype = t.dtype if dtype is None else dtype
    values = codes_to_values(unpack_codes(t.codes)).unflatten(-1, (-1, BLOCK_SIZE))
    block_values = values * t.scales.to(torch.float32).unsqueeze(-1)
    decode = t.weight_scale_2.to(torch.float32)
    out = block_values * decode.reshape(decode.shape + (1, 1))
    return out.flatten(-2).reshape(t.shape).to(out_dtype)


def quantize_dequantize(
    x: torch.Tensor, global_amax: AmaxLike = None, block_2d: bool = False
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in x's dtype, without autograd."""
    return dequantize(quantize(x, global_amax=global_amax, block_2d=block_2d), x.dtype)
