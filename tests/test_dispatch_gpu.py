"""On CUDA the reference entry points dispatch to the Triton kernels, with the reference's results."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.nvfp4 import quantize
from megatron_quads.nvfp4.backend import reference_path, use_kernels
from megatron_quads.nvfp4.fused import fake_quant_values
from megatron_quads.nvfp4.reblock import reblock_columns
from megatron_quads.rollout.rac import rac_linear, select_channels
from megatron_quads.rollout.w4a4 import w4a16_linear

pytestmark = pytest.mark.gpu


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_dispatch_is_on_for_cuda_and_off_for_cpu_or_when_disabled() -> None:
    x = torch.randn(4, 32, device="cuda")
    assert use_kernels(x) and not use_kernels(x.cpu())
    with reference_path():
        assert not use_kernels(x)
    assert use_kernels(x)


def test_quantize_and_fake_quant_dispatch_give_the_reference_bytes() -> None:
    x = torch.randn(96, 512, device="cuda", dtype=torch.bfloat16) * 3
    fast = quantize(x)
    with reference_path():
        ref = quantize(x)
    assert torch.equal(fast.codes, ref.codes) and torch.equal(_bytes(fast.scales), _bytes(ref.scales))
    assert torch.equal(fast.weight_scale_2, ref.weight_scale_2)
    amax = x.abs().amax().float()
    fq = fake_quant_values(x, amax)
    with reference_path():
        fq_ref = fake_quant_values(x, amax)
    assert torch.equal(_bytes(fq), _bytes(fq_ref))


def test_linears_dispatch_within_fp32_accumulation_error() -> None:
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    w = quantize(torch.randn(192, 256, device="cuda") * 0.05)
    y = w4a16_linear(x, w)
    with reference_path():
        y_ref = w4a16_linear(x, w)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=1e-2)  # bf16 output rounding
    channels = select_channels(torch.rand(256, device="cuda"), 0.25).cuda()
    residual = reblock_columns(w, channels)
    y = rac_linear(x, w, channels, residual)
    with reference_path():
        y_ref = rac_linear(x, w, channels, residual)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=1e-2)
