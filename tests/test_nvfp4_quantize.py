"""quantize / dequantize / fake_quant behaviour beyond the TE golden vectors."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.nvfp4 import (
    FP8_E4M3_MAX,
    GLOBAL_SCALE_DIVISOR,
    dequantize,
    fake_quant,
    quantize,
    quantize_dequantize,
    relative_error,
    unpack_codes,
)
from megatron_quads.nvfp4.metrics import per_channel_mse, sqnr_db


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_shapes_dtypes_and_error_level(dtype: torch.dtype) -> None:
    x = torch.randn(3, 5, 64).to(dtype)
    t = quantize(x)
    assert t.codes.shape == (3, 5, 32) and t.codes.dtype == torch.uint8
    assert t.scales.shape == (3, 5, 4) and t.scales.dtype == torch.float8_e4m3fn
    assert t.weight_scale_2.dtype == torch.float32
    assert t.weight_scale_2.item() == pytest.approx(x.abs().max().item() / GLOBAL_SCALE_DIVISOR, rel=1e-6)
    y = dequantize(t)
    assert y.dtype == dtype and y.shape == x.shape
    # NVFP4 on Gaussian data: ~10% relative error; far from 0 (no-op) and far from 1 (garbage)
    assert 0.05 < relative_error(x, y) < 0.15


def test_leading_dims_equal_flattened() -> None:
    x = torch.randn(2, 3, 4, 32, dtype=torch.bfloat16)
    a, b = quantize(x), quantize(x.reshape(-1, 32))
    assert torch.equal(a.codes.reshape(-1, 16), b.codes)
    assert _same_bytes(a.scales.reshape(-1, 2), b.scales)


def test_shared_global_amax_gives_one_decode_scale() -> None:
    gate, up = torch.randn(8, 32), 3 * torch.randn(8, 32)
    shared = torch.maximum(gate.abs().max(), up.abs().max())
    tg, tu = quantize(gate, global_amax=shared), quantize(up, global_amax=shared)
    assert torch.equal(tg.weight_scale_2, tu.weight_scale_2)
    # gate and up quantized with the shared amax equal the halves of the concatenation
    cat = quantize(torch.cat([gate, up]))
    assert torch.equal(torch.cat([tg.codes, tu.codes]), cat.codes)
    assert _same_bytes(torch.cat([tg.scales, tu.scales]), cat.scales)


def test_per_row_global_amax() -> None:
    x = torch.randn(4, 32) * torch.tensor([[1e-3], [1.0], [10.0], [1e3]])
    per_row = quantize(x, global_amax=x.abs().amax(dim=-1))
    for row in range(4):
        alone = quantize(x[row])
        assert torch.equal(per_row.codes[row], alone.codes)
        assert _same_bytes(per_row.scales[row], alone.scales)
    assert torch.equal(dequantize(per_row)[2], dequantize(quantize(x[2])))


def test_global_amax_wrong_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"global_amax of shape \(3,\).*leading dims \(4,\)"):
        quantize(torch.randn(4, 32), global_amax=torch.ones(3))
    with pytest.raises(ValueError, match="finite and >= 0"):
        quantize(torch.randn(4, 32), global_amax=-1.0)


def test_block_2d_scales_are_tile_maxima() -> None:
    x = torch.randn(40, 48)  # 3 row tiles (the last one partial), 3 column blocks
    t = quantize(x, block_2d=True)
    assert t.scales.shape == (40, 3)
    for rt in range(3):
        rows = slice(16 * rt, min(16 * rt + 16, 40))
        tile_scales = t.scales[rows].to(torch.float32)
        assert (tile_scales == tile_scales[0]).all(), "every row of a 16-row tile carries one scale"
        for c in range(3):
            tile = x[rows, 16 * c : 16 * c + 16]
            # a 1x16 block filled with the tile's amax gets the scale the tile must have
            block_at_tile_amax = torch.full((1, 16), tile.abs().max().item())
            expected = quantize(block_at_tile_amax, global_amax=x.abs().max()).scales[0, :1]
            assert _same_bytes(t.scales[rows.start, c : c + 1], expected)
    # 2D scales are never smaller than 1D scales (a tile's amax >= each row's block amax)
    one_d = quantize(x)
    assert (t.scales.to(torch.float32) >= one_d.scales.to(torch.float32)).all()


def test_zero_tensor_and_zero_blocks() -> None:
    t = quantize(torch.zeros(2, 32))
    assert t.weight_scale_2.item() == 0.0
    assert (t.scales.to(torch.float32) == 0).all() and (t.codes == 0).all()
    assert (dequantize(t) == 0).all()
    x = torch.randn(1, 32)
    x[0, :16] = 0
    t = quantize(x)
    assert t.scales[0, 0].to(torch.float32) == 0 and t.scales[0, 1].to(torch.float32) > 0


def test_amax_smaller_than_data_saturates() -> None:
    x = torch.tensor([[8.0] + [1.0] * 15])
    t = quantize(x, global_amax=1.0)  # block scale would be 8*448 > 448: clamped
    assert t.scales.to(torch.float32).max() == FP8_E4M3_MAX
    assert unpack_codes(t.codes)[0, 0] == 7  # saturates at +6


@pytest.mark.parametrize(
    ("bad", "error", "pattern"),
    [
        (torch.tensor([[1.0, float("nan")] * 8]), ValueError, r"\(1, 16\).*8 NaN and 0 Inf"),
        (torch.tensor([[float("inf")] * 16]), ValueError, r"\(1, 16\).*0 NaN and 16 Inf"),
        (torch.randn(2, 24), ValueError, r"\(2, 24\).*multiple of the block size 16"),
        (torch.randn(2, 32, dtype=torch.float64), TypeError, r"\(2, 32\).*float64.*supported dtypes"),
        (torch.ones(2, 32, dtype=torch.int32), TypeError, "supported dtypes"),
        (torch.tensor(1.0), ValueError, r"shape \(\)"),
    ],
)
def test_bad_input_names_shape_and_problem(bad: torch.Tensor, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        quantize(bad)


def test_block_2d_needs_a_matrix() -> None:
    with pytest.raises(ValueError, match="2D"):
        quantize(torch.randn(32), block_2d=True)


def test_fake_quant_forward_and_straight_through_backward() -> None:
    w = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    y = fake_quant(w)
    assert torch.equal(y, quantize_dequantize(w.detach()))
    assert not torch.equal(y, w.detach())
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.equal(w.grad, grad)


def test_fake_quant_with_shared_amax_tensor_requires_no_grad_for_amax() -> None:
    w = torch.randn(8, 32, requires_grad=True)
    amax = w.abs().max()  # part of the graph; fake_quant must detach it
    fake_quant(w, global_amax=amax).sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_metrics() -> None:
    ref = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    approx = ref + torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(ref, approx) == pytest.approx((10**0.5) / (30**0.5))
    assert per_channel_mse(ref, approx).tolist() == [0.0, 5.0]
    assert per_channel_mse(ref, approx, channel_dim=0).tolist() == [0.5, 4.5]
    assert sqnr_db(ref, approx) == pytest.approx(10 * torch.log10(torch.tensor(3.0)).item(), rel=1e-6)
    with pytest.raises(ValueError, match="shape mismatch"):
        per_channel_mse(ref, approx[0])


@pytest.mark.gpu
def test_cuda_matches_cpu_bytes() -> None:
    x = torch.randn(64, 256, dtype=torch.bfloat16) * 3
    cpu, gpu = quantize(x), quantize(x.cuda())
    assert torch.equal(cpu.codes, gpu.codes.cpu()) and _same_bytes(cpu.scales, gpu.scales.cpu())
    assert torch.equal(dequantize(cpu), dequantize(gpu).cpu())
