"""E2M1 rounding and nibble packing."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.nvfp4 import (
    E2M1_MAGNITUDES,
    codes_to_values,
    pack_codes,
    round_to_e2m1_codes,
    unpack_codes,
)


def test_grid_values_map_to_their_own_codes() -> None:
    grid = torch.tensor(E2M1_MAGNITUDES)
    assert round_to_e2m1_codes(grid).tolist() == list(range(8))
    assert round_to_e2m1_codes(-grid[1:]).tolist() == list(range(9, 16))
    assert torch.equal(codes_to_values(torch.arange(16, dtype=torch.uint8))[:8], grid)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # exact midpoints: nearest-even picks the even code
        (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
        # just off the midpoints
        (0.2500001, 0.5), (0.7499999, 0.5), (1.2500001, 1.5), (1.7499999, 1.5),
        (2.5000002, 3.0), (3.4999998, 3.0), (5.0000005, 6.0),
        # saturation
        (6.0, 6.0), (7.0, 6.0), (1e30, 6.0),
    ],
)
def test_round_to_nearest_even_and_saturate(value: float, expected: float) -> None:
    for sign in (1.0, -1.0):
        code = round_to_e2m1_codes(torch.tensor([sign * value], dtype=torch.float32))
        assert codes_to_values(code).item() == sign * expected


def test_signed_zero_codes() -> None:
    codes = round_to_e2m1_codes(torch.tensor([0.0, -0.0, -0.1, -0.25, -0.2500001]))
    # -0.0 is code 0 (TE tests x >= 0 first); small negatives round to negative zero (code 8)
    assert codes.tolist() == [0, 0, 8, 8, 9]


def test_pack_puts_even_element_in_low_nibble() -> None:
    codes = torch.tensor([1, 2, 15, 0], dtype=torch.uint8)
    assert pack_codes(codes).tolist() == [0x21, 0x0F]
    assert torch.equal(unpack_codes(pack_codes(codes)), codes)


def test_pack_rejects_odd_length_and_unpack_rejects_non_uint8() -> None:
    with pytest.raises(ValueError, match=r"even last dimension.*\(3,\)"):
        pack_codes(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        unpack_codes(torch.zeros(4, dtype=torch.int32))


def test_bucketize_and_comparison_paths_agree() -> None:
    from megatron_quads.nvfp4.format import magnitude_index

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat([ties, torch.nextafter(ties, torch.tensor(0.0)), torch.nextafter(ties, torch.tensor(9.0))])
    values = torch.cat([near, -near, torch.randn(10_000) * 3, torch.tensor([0.0, -0.0, 6.0, 1e30])])
    by_search = magnitude_index(values, use_bucketize=True)
    by_compare = magnitude_index(values, use_bucketize=False)
    assert torch.equal(by_search, by_compare)
    assert by_compare[:7].tolist() == [0, 2, 2, 4, 4, 6, 6]  # ties to even
