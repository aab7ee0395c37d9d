"""The NVFP4 error table printed by ``megatron-quads demo``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_quads.nvfp4 import quantize, relative_error, sqnr_db


@dataclass(frozen=True)
class ErrorRow:
    """Quantization error of one input under one blocking."""

    tensor: str
    blocking: str
    relative_error: float
    sqnr_db: float
    max_abs_error: float


def demo_tensors(rows: int = 256, cols: int = 1024, seed: int = 0) -> dict[str, torch.Tensor]:
    """A few bf16 tensors with the shapes of trouble NVFP4 meets in LLMs."""
    gen = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(rows, cols, generator=gen)
    outliers = gaussian.clone()
    outliers[:, torch.randperm(cols, generator=gen)[: cols // 64]] *= 50.0  # a few hot channels
    # Student-t with 2 degrees of freedom: z / sqrt(chi2_2 / 2), drawn from the same generator
    chi2 = torch.randn(2, rows, cols, generator=gen).square().sum(0)
    heavy_tail = torch.randn(rows, cols, generator=gen) / (chi2 / 2).sqrt()
    return {
        "gaussian": gaussian.bfloat16(),
        "outlier channels": outliers.bfloat16(),
        "student-t (df=2)": heavy_tail.bfloat16(),
    }


def error_table(tensors: dict[str, torch.Tensor]) -> list[ErrorRow]:
    """Quantize each tensor with 1x16 and 16x16 blocks and measure the error."""
    rows = []
    for name, x in tensors.items():
        for blocking, block_2d in (("1x16", False), ("16x16", True)):
            y = quantize(x, block_2d=block_2d).dequantize()
            rows.append(
                ErrorRow(
                    tensor=name,
                    blocking=blocking,
                    relative_error=relative_error(x, y),
                    sqnr_db=sqnr_db(x, y),
                    max_abs_error=float((y.float() - x.float()).abs().max()),
                )
            )
    return rows
