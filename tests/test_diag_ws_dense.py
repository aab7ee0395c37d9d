"""benchmarks/diag_ws_dense.py poses split-K of a dense GEMM as experts of the grouped kernel; the
timing means something only if the split mapping is right: the experts' partial products summed over
the splits must be the dense product with the same (per-split quantized) weight."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from diag_ws_dense import as_experts

from megatron_quads.nvfp4.quantize import dequantize
from megatron_quads.rollout.grouped import grouped_w4a16_linear


def test_split_k_as_experts_sums_to_the_dense_product() -> None:
    torch.manual_seed(0)
    m, n, k, splits = 16, 48, 512, 4
    x = torch.randn(m, k).to(torch.bfloat16)
    w = torch.randn(n, k)
    rows, weight, offsets = as_experts(x, w, splits)
    assert rows.shape == (splits * m, k // splits) and tuple(weight.shape) == (splits, n, k // splits)
    assert offsets.tolist() == list(range(0, splits * m + 1, m))
    partials = grouped_w4a16_linear(rows, weight, offsets).float().reshape(splits, m, n)
    # the same weight as one [N, K] matrix: split s's dequantized values in columns s * K/S ..
    dense = dequantize(weight, torch.float32).permute(1, 0, 2).reshape(n, k)
    expected = x.float() @ dense.t()
    torch.testing.assert_close(partials.sum(0), expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))
