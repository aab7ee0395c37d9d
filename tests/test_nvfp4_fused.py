"""The trainer's fused fake quant is bit-identical to dequantize(quantize(x))."""

from __future__ import annotations

import pytest
import torch
from test_nvfp4_golden import CASES, TENSORS

from megatron_quads.nvfp4 import compute_global_amax, quantize_dequantize
from megatron_quads.nvfp4.fused import fake_quant_values

ONE_D_CASES = [c for c in CASES if c["block"] == "1x16"]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("case", ONE_D_CASES, ids=lambda c: c["name"])
def test_golden_inputs_match_reference_bits(case: dict) -> None:
    x = TENSORS[f"{case['name']}.x"]
    amax = compute_global_amax(x)
    assert _same_bits(fake_quant_values(x, amax), quantize_dequantize(x))  # -0.0 and +0.0 included


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_stacked_experts_with_per_expert_amax(dtype: torch.dtype) -> None:
    w = (torch.randn(6, 32, 64) * torch.logspace(-3, 3, 6)[:, None, None]).to(dtype)
    amax = w.abs().amax(dim=(1, 2)).float()
    expected = torch.stack([quantize_dequantize(w[e]) for e in range(6)])
    assert _same_bits(fake_quant_values(w, amax[:, None]), expected)


def test_shared_amax_larger_than_data() -> None:
    x = torch.randn(16, 48)
    assert _same_bits(fake_quant_values(x, torch.tensor(100.0)), quantize_dequantize(x, global_amax=100.0))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ONE_D_CASES, ids=lambda c: c["name"])
def test_cuda_matches_reference_bits(case: dict) -> None:
    x = TENSORS[f"{case['name']}.x"]
    expected = quantize_dequantize(x)
    got = fake_quant_values(x.cuda(), compute_global_amax(x).cuda()).cpu()
    assert _same_bits(got, expected)


@pytest.mark.gpu
def test_cuda_on_large_random_expert_stacks() -> None:
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        w = (torch.randn(8, 512, 1024, generator=gen) * 0.02).to(torch.bfloat16)
        w[0, 0, :16] = 0  # a zero block
        amax = w.abs().amax(dim=(1, 2)).float()
        expected = torch.stack([quantize_dequantize(w[e]) for e in range(8)])
        got = fake_quant_values(w.cuda(), amax[:, None].cuda()).cpu()
        assert _same_bits(got, expected)
