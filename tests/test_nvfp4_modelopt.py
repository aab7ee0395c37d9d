"""Agreement with NVIDIA ModelOpt's NVFP4QTensor, an independent implementation.

ModelOpt divides (``x / (scale * weight_scale_2)``) where Transformer Engine, and so this project,
multiplies by a reciprocal. The two can round differently only when a value sits on a rounding
boundary (an E2M1 threshold, or the midpoint between two E4M3 scales) to within fp32 rounding. The
test checks that every disagreement is such a tie, and that ties are rare.
"""

from __future__ import annotations

import pytest
import torch

from megatron_quads.nvfp4 import dequantize, quantize, unpack_codes
from megatron_quads.nvfp4.tensor import NVFP4Tensor

nvfp4_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
NVFP4QTensor = nvfp4_tensor.NVFP4QTensor

E2M1_THRESHOLDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
TIE_TOLERANCE = 1e-6  # a few fp32 ulps, relative


def _near_e2m1_threshold(u: torch.Tensor) -> torch.Tensor:
    dist = (u.abs().unsqueeze(-1) - E2M1_THRESHOLDS).abs().amin(dim=-1)
    return dist <= TIE_TOLERANCE * u.abs().clamp(min=0.25)


def _near_e4m3_midpoint(v: torch.Tensor) -> torch.Tensor:
    lo = (v * (1 - TIE_TOLERANCE)).float().to(torch.float8_e4m3fn).float()
    hi = (v * (1 + TIE_TOLERANCE)).float().to(torch.float8_e4m3fn).float()
    return lo != hi


def _modelopt_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qtensor, scale, scale_2 = NVFP4QTensor.quantize(x.clone(), 16)
    return qtensor._quantized_data, scale, scale_2


def _compare(x: torch.Tensor) -> dict[str, int]:
    ours = quantize(x)
    mo_packed, mo_scale, mo_scale_2 = _modelopt_quantize(x)
    assert mo_scale_2.float().item() == ours.weight_scale_2.item()

    ws2 = ours.weight_scale_2.double()
    block_amax = x.double().unflatten(-1, (-1, 16)).abs().amax(-1)
    exact_scale = block_amax / (6 * ws2)
    ours_scale = ours.scales.float()
    # ModelOpt clamps scales to >= 2^-9 (zero blocks too); TE keeps zero and subnormal rounding
    comparable = exact_scale >= 2.0**-9
    scale_diff = comparable & (ours_scale != mo_scale.float())
    assert _near_e4m3_midpoint(exact_scale[scale_diff]).all(), "a block-scale disagreement that is not a tie"
    assert (ours_scale[block_amax == 0] == 0).all()

    same_block = (comparable & ~scale_diff).repeat_interleave(16, dim=-1)
    ours_codes, mo_codes = unpack_codes(ours.codes), unpack_codes(mo_packed)
    code_diff = same_block & (ours_codes != mo_codes)
    u = x.double() / (ours_scale.double().repeat_interleave(16, dim=-1) * ws2)
    assert _near_e2m1_threshold(u[code_diff]).all(), "a code disagreement that is not a tie"
    return {
        "blocks": int(comparable.sum()),
        "scale_ties": int(scale_diff.sum()),
        "codes": int(same_block.sum()),
        "code_ties": int(code_diff.sum()),
    }


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_agrees_with_modelopt_except_at_ties(magnitude: float) -> None:
    x = (torch.randn(256, 512) * magnitude).to(torch.bfloat16)
    counts = _compare(x)
    assert counts["scale_ties"] <= 0.02 * counts["blocks"]
    assert counts["code_ties"] <= 0.01 * counts["codes"]


def test_exact_ties_agree() -> None:
    # global amax 6 and a block amax of 6 make every scale exact: elements on the E2M1 midpoints are
    # exact ties, where division and reciprocal-multiplication give the same value and so the same code
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    x = torch.stack([ties, -ties, ties * 0.5 + 0.01]).to(torch.float32)
    counts = _compare(x)
    assert counts["codes"] == x.numel() and counts["code_ties"] == 0


def test_tie_classifiers_are_not_vacuous() -> None:
    assert _near_e2m1_threshold(torch.tensor([0.75, -3.5, 5.0000001], dtype=torch.float64)).all()
    assert not _near_e2m1_threshold(torch.tensor([0.7, 3.0, 5.01], dtype=torch.float64)).any()
    # 1.0625 is halfway between the e4m3 neighbours 1.0 and 1.125
    assert _near_e4m3_midpoint(torch.tensor([1.0625, 1.0625 * (1 + 1e-7)], dtype=torch.float64)).all()
    assert not _near_e4m3_midpoint(torch.tensor([1.03, 1.1], dtype=torch.float64)).any()


def test_modelopt_dequantizes_our_tensors() -> None:
    x = torch.randn(64, 128, dtype=torch.bfloat16) * 7
    ours = quantize(x)
    qtensor = NVFP4QTensor(x.shape, torch.float32, ours.codes)
    theirs = qtensor.dequantize(
        dtype=torch.float32, scale=ours.scales, double_scale=ours.weight_scale_2, block_sizes={-1: 16}
    )
    mine = dequantize(ours, torch.float32)
    # ModelOpt multiplies e2m1 * (scale * weight_scale_2); we compute (e2m1 * scale) * weight_scale_2
    # (one rounding). The two orders differ by at most one fp32 rounding.
    assert torch.allclose(theirs, mine, rtol=2**-22, atol=0)
    assert torch.equal(theirs.to(torch.bfloat16), mine.to(torch.bfloat16)) or (
        (theirs.to(torch.bfloat16) != mine.to(torch.bfloat16)).float().mean() < 1e-3
    )
    assert isinstance(ours, NVFP4Tensor)
