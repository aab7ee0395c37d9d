"""The sm_100 path's operands (vLLM's FP4 GEMM over the augmented K), with a reference GEMM in
vLLM's place: the GEMM itself needs FP4 tensor cores and is not run here."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.nvfp4 import NVFP4Tensor, quantize
from megatron_quads.nvfp4.format import codes_to_values, unpack_codes
from megatron_quads.nvfp4.reblock import reblock_columns
from megatron_quads.nvfp4.swizzle import unswizzle_scales
from megatron_quads.rollout.rac import rac_linear, select_channels
from megatron_quads.vllm_plugin.fp4_gemm import AugmentedWeight, fp4_gemm_supported, fp4_linear


def _values(codes: torch.Tensor, swizzled: torch.Tensor) -> torch.Tensor:
    """Block values of packed codes ``[R, K/2]`` and swizzled scales, as the FP4 GEMM reads them."""
    rows, k = codes.shape[0], codes.shape[1] * 2
    scales = unswizzle_scales(swizzled, rows, k // 16).to(torch.float32)
    return codes_to_values(unpack_codes(codes)).reshape(rows, k // 16, 16).mul(scales[..., None]).reshape(rows, k)


def reference_fp4_gemm(a, b, a_scales, b_scales, alpha, out_dtype):
    """vLLM's ``cutlass_scaled_fp4_mm`` contract: ``(A values) @ (B values)^T * alpha`` in out_dtype."""
    return (_values(a, a_scales) @ _values(b, b_scales).T * alpha).to(out_dtype)


@pytest.mark.parametrize("in_features, count", [(128, 0), (128, 32), (96, 16)])
def test_the_augmented_k_gemm_gives_the_projects_w4a4_rac_product(in_features: int, count: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, in_features, generator=gen)
    weight = quantize(w.to(torch.bfloat16))
    x = (torch.randn(10, in_features, generator=gen) * torch.linspace(0.1, 4, in_features)).to(torch.bfloat16)
    channels = select_channels(torch.rand(in_features, generator=gen), count / in_features)
    residual = reblock_columns(weight, channels) if count else None
    augmented = AugmentedWeight.prepare(weight, channels, residual)
    assert augmented.codes.shape[1] * 2 % 64 == 0  # K + |S| padded to whole scale tiles
    y = fp4_linear(x, augmented, gemm=reference_fp4_gemm)
    expected = rac_linear(x, weight, channels, residual)
    torch.testing.assert_close(y.float(), expected.float(), rtol=1e-2, atol=1e-2 * float(expected.abs().max()))
    if count:  # the tail is in the product
        plain = fp4_linear(x, AugmentedWeight.prepare(weight), gemm=reference_fp4_gemm)
        assert not torch.allclose(plain.float(), y.float())


def test_no_fp4_gemm_off_sm100() -> None:
    assert not fp4_gemm_supported(torch.device("cpu"))
    with pytest.raises(ValueError, match="W_S is missing"):
        weight = quantize(torch.randn(16, 64))
        AugmentedWeight.prepare(weight, torch.arange(16, dtype=torch.int32), None)
    assert isinstance(weight, NVFP4Tensor)
