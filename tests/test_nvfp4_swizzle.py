"""The 128x4-tile swizzled scale layout read by cuBLAS / CUTLASS FP4 GEMMs."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.nvfp4 import swizzle_scales, swizzled_shape, unswizzle_scales


def test_every_scale_lands_at_the_documented_byte() -> None:
    rows, cols = 300, 9  # pads to 384 x 12: 3 x 3 tiles
    ids = torch.arange(rows * cols, dtype=torch.int64).reshape(rows, cols) + 1
    flat = swizzle_scales(ids).flatten()
    rows_pad, cols_pad = swizzled_shape(rows, cols)
    assert (rows_pad, cols_pad) == (384, 12)
    tiles_per_row = cols_pad // 4
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * tiles_per_row + c // 4
            rr, cc = r % 128, c % 4
            offset = tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc
            assert flat[offset] == ids[r, c]
    assert int((flat == 0).sum()) == rows_pad * cols_pad - rows * cols  # padding is zero


def test_unswizzle_rejects_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"trailing shape \(128, 4\)"):
        unswizzle_scales(torch.zeros(64, 4, dtype=torch.uint8), 10, 2)
