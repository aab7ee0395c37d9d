"""Property tests (hypothesis) of the NVFP4 reference: idempotence, error bound, round-trips."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from megatron_quads.nvfp4 import (
    dequantize,
    global_encode_scale,
    pack_codes,
    quantize,
    swizzle_scales,
    unpack_codes,
    unswizzle_scales,
)
from megatron_quads.nvfp4.format import codes_to_values

SETTINGS = settings(max_examples=60, deadline=None)

# Half the distance to the farther neighbour of each E2M1 magnitude: the largest rounding error of a
# value that rounds to it (6 also absorbs saturation: block-scale rounding overshoots by < 1/16).
_HALF_STEP = {0.0: 0.25, 0.5: 0.25, 1.0: 0.25, 1.5: 0.25, 2.0: 0.5, 3.0: 0.5, 4.0: 1.0, 6.0: 1.0}


@st.composite
def float_matrices(draw: st.DrawFn, max_rows: int = 8, max_blocks: int = 4) -> torch.Tensor:
    rows = draw(st.integers(1, max_rows))
    cols = 16 * draw(st.integers(1, max_blocks))
    magnitude = draw(st.sampled_from([1e-4, 1.0, 1e4]))
    elements = st.floats(-1.0, 1.0, allow_nan=False, width=32)
    values = draw(arrays(np.float32, (rows, cols), elements=elements))
    return torch.from_numpy(values) * magnitude


@SETTINGS
@given(float_matrices(), st.booleans())
def test_quantize_is_idempotent_on_its_own_output(x: torch.Tensor, block_2d: bool) -> None:
    # Outside the property (docs/nvfp4.md): an amax so small that S_enc is capped at FLT_MAX, and
    # blocks whose E4M3 scale is subnormal (< 2^-6), whose dequantized values no longer pin the scale.
    assume(float(x.abs().max()) > 1e-30)
    first = quantize(x, block_2d=block_2d)
    y = dequantize(first, torch.float32)
    again = dequantize(quantize(y, global_amax=first.global_amax, block_2d=block_2d), torch.float32)
    normal_scale = (first.scales.to(torch.float32) >= 2.0**-6).repeat_interleave(16, dim=-1)
    assert torch.equal(again[normal_scale], y[normal_scale])


@SETTINGS
@given(float_matrices())
def test_error_is_at_most_half_a_grid_step_times_block_scale(x: torch.Tensor) -> None:
    t = quantize(x)
    y = dequantize(t, torch.float32)
    decode = 1.0 / global_encode_scale(t.global_amax).double()
    block_unit = (t.scales.to(torch.float64) * decode).repeat_interleave(16, dim=-1)
    magnitudes = codes_to_values(unpack_codes(t.codes)).abs()
    half_step = torch.tensor([_HALF_STEP[float(m)] for m in magnitudes.flatten()], dtype=torch.float64)
    bound = half_step.reshape(x.shape) * block_unit
    # a block whose scale underflows to 0 in e4m3 dequantizes to 0; its amax is below half the
    # smallest e4m3 subnormal (2^-10) in scale units
    underflow = (t.scales.to(torch.float64) == 0).repeat_interleave(16, dim=-1)
    bound = torch.where(underflow, 6 * 2.0**-10 * decode, bound)
    # a subnormal e4m3 scale (< 2^-6) may round down by up to half its step (2^-10): elements near the
    # block amax then saturate at 6 and lose up to 6 * 2^-10 scale units on top of the rounding
    subnormal = (t.scales.to(torch.float64) < 2.0**-6).repeat_interleave(16, dim=-1)
    bound = bound + torch.where(subnormal, 6 * 2.0**-10 * decode, torch.zeros_like(bound))
    err = (y.double() - x.double()).abs()
    assert (err <= bound * (1 + 1e-6) + 1e-30).all()


@SETTINGS
@given(st.lists(st.integers(0, 15), min_size=1, max_size=64).filter(lambda c: len(c) % 2 == 0))
def test_pack_unpack_round_trip(codes: list[int]) -> None:
    c = torch.tensor(codes, dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(c)), c)


@SETTINGS
@given(st.lists(st.integers(0, 255), min_size=1, max_size=64))
def test_unpack_pack_round_trip_on_any_byte(raw: list[int]) -> None:
    b = torch.tensor(raw, dtype=torch.uint8)
    assert torch.equal(pack_codes(unpack_codes(b)), b)


@SETTINGS
@given(st.integers(0, 3), st.integers(1, 300), st.integers(1, 20))
def test_swizzle_round_trip(lead: int, rows: int, cols: int) -> None:
    shape = (lead, rows, cols) if lead else (rows, cols)
    scales = torch.randint(0, 256, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
    swizzled = swizzle_scales(scales)
    assert swizzled.dtype == torch.float8_e4m3fn
    back = unswizzle_scales(swizzled, rows, cols)
    assert torch.equal(back.view(torch.uint8), scales.view(torch.uint8))
