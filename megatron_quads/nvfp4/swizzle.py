"""Block-scale layouts: linear ``[rows, K/16]`` <-> the 128x4-tile swizzled layout of FP4 GEMMs.

cuBLAS and CUTLASS block-scaled GEMMs read scales in tiles of 128 rows x 4 scale columns (512
bytes). Rows are padded to a multiple of 128 and scale columns to a multiple of 4 (padding is zero);
tiles are laid out row-tile major, then column-tile; inside a tile the scale of row ``r`` and
column ``c`` sits at byte ``(r % 32) * 16 + (r // 32) * 4 + c``.
"""

from __future__ import annotations

import torch

TILE_ROWS = 128
TILE_COLS = 4


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def swizzled_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """Padded ``(rows, scale_cols)`` of the swizzled layout."""
    return _round_up(rows, TILE_ROWS), _round_up(scale_cols, TILE_COLS)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Linear ``[..., rows, cols]`` scales -> swizzled ``[..., rows_pad, cols_pad]`` (same dtype)."""
    if scales.ndim < 2:
        raise ValueError(f"swizzle_scales needs [..., rows, cols] scales, got shape {tuple(scales.shape)}")
    *lead, rows, cols = scales.shape
    rows_pad, cols_pad = swizzled_shape(rows, cols)
    raw = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    padded = torch.zeros((*lead, rows_pad, cols_pad), dtype=raw.dtype, device=raw.device)
    padded[..., :rows, :cols] = raw
    # row = t*128 + g*32 + i (g = r // 32 within the tile, i = r % 32); col = u*4 + c
    tiled = padded.unflatten(-2, (rows_pad // TILE_ROWS, 4, 32)).unflatten(-1, (cols_pad // TILE_COLS, TILE_COLS))
    n = len(lead)
    # [..., t, g, i, u, c] -> [..., t, u, i, g, c]
    perm = list(range(n)) + [n + 0, n + 3, n + 2, n + 1, n + 4]
    out = tiled.permute(perm).reshape(*lead, rows_pad, cols_pad)
    return out.view(scales.dtype) if scales.element_size() == 1 else out


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: swizzled ``[..., rows_pad, cols_pad]`` -> ``[..., rows, cols]``."""
    rows_pad, cols_pad = swizzled_shape(rows, cols)
    if swizzled.ndim < 2 or tuple(swizzled.shape[-2:]) != (rows_pad, cols_pad):
        raise ValueError(
            f"swizzled scales for {rows}x{cols} must have trailing shape {(rows_pad, cols_pad)}, "
            f"got {tuple(swizzled.shape)}"
        )
    *lead, _, _ = swizzled.shape
    raw = swizzled.view(torch.uint8) if swizzled.element_size() == 1 else swizzled
    tiled = raw.reshape(*lead, rows_pad // TILE_ROWS, cols_pad // TILE_COLS, 32, 4, TILE_COLS)
    n = len(lead)
    # [..., t, u, i, g, c] -> [..., t, g, i, u, c]
    perm = list(range(n)) + [n + 0, n + 3, n + 2, n + 1, n + 4]
    linear = tiled.permute(perm).reshape(*lead, rows_pad, cols_pad)[..., :rows, :cols].contiguous()
    return linear.view(swizzled.dtype) if swizzled.element_size() == 1 else linear
