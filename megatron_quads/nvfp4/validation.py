"""What every NVFP4 quantizer (the PyTorch reference and the Triton kernels) accepts as input."""

from __future__ import annotations

import torch

from megatron_quads.nvfp4.format import BLOCK_SIZE, SUPPORTED_DTYPES


def describe_tensor(x: torch.Tensor) -> str:
    """``x``'s shape and dtype, as error messages name a tensor."""
    return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"


def validate_input(x: torch.Tensor, block_size: int = BLOCK_SIZE, block_2d: bool = False) -> None:
    """Raise a clear error if ``x`` cannot be quantized to NVFP4: a floating tensor of a supported
    dtype, blocks of 16 along a last dimension that is a non-zero multiple of 16, at least 2
    dimensions for 16x16 tiles, and only finite values."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"NVFP4 quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"NVFP4 quantize got a {describe_tensor(x)}; supported dtypes are bfloat16, float16 and "
            "float32: cast the tensor first"
        )
    if block_size != BLOCK_SIZE:
        raise ValueError(f"NVFP4 uses blocks of {BLOCK_SIZE} elements; block_size={block_size} is not supported")
    if x.ndim == 0 or x.shape[-1] % block_size:
        raise ValueError(
            f"NVFP4 quantize got a {describe_tensor(x)}: the last dimension must be a non-zero multiple of "
            f"the block size {block_size}; pad it or quantize a reshaped view"
        )
    if block_2d and x.ndim < 2:
        raise ValueError(f"2D (16x16) block scaling needs at least 2 dimensions, got a {describe_tensor(x)}")
    if x.numel() and not bool(torch.isfinite(x).all()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise ValueError(
            f"NVFP4 quantize got a {describe_tensor(x)} with {n_nan} NaN and {n_inf} Inf values; "
            "NVFP4 has no encoding for them: find where they come from upstream"
        )
