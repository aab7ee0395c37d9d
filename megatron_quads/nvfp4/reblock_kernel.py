"""Triton ``W_S`` re-blocking of stacked expert weights, byte for byte the reference
(:mod:`megatron_quads.nvfp4.reblock`, which dispatches here on CUDA).

For each expert ``e``, each of its sorted channel sets' 16-channel blocks and a tile of rows, one
program gathers the channels' codes and block scales from ``q(W)``, rebuilds their fp32 values as
``dequantize`` does (``(e2m1 * scale) * weight_scale_2``) and quantizes them as one NVFP4 block with
the expert's recovered global amax; a block that is exactly one block of ``q(W)`` is copied instead.
It reads only the gathered bytes and writes only ``W_S``: nothing of size ``[n, N, |S|]`` in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_quads.nvfp4.triton_codec import (
    RCP_6,
    block_scale,
    e2m1_code,
    e2m1_to_f32,
    e4m3_to_f32,
    element_encode_scale,
    global_scales,
)

_ROWS, _SB = 16, 8  # rows and 16-channel blocks per program


@triton.jit(do_not_specialize=["N", "KH", "S"])
def _reblock_kernel(codes_ptr, scales_ptr, ws2_ptr, amax_ptr, ch_ptr, out_codes_ptr, out_scales_ptr,
                    N, KH, S, ROWS: tl.constexpr, SB: tl.constexpr):
    """Grid ``(experts * cdiv(N, ROWS), cdiv(S / 16, SB))``; ``KH = K / 2`` bytes of codes per row."""
    row_tiles = tl.cdiv(N, ROWS)
    expert = tl.program_id(0) // row_tiles
    rows = (tl.program_id(0) % row_tiles) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < N
    sblocks = tl.program_id(1) * SB + tl.arange(0, SB)
    block_mask = sblocks < S // 16
    e64 = expert.to(tl.int64)
    ch = tl.load(ch_ptr + e64 * S + sblocks[:, None] * 16 + tl.arange(0, 16)[None, :], mask=block_mask[:, None], other=0)
    first = tl.min(ch, axis=1)  # channels are sorted: the block's first and last
    aligned = (first % 16 == 0) & (tl.max(ch, axis=1) - first == 15)  # [SB]

    row_base = e64 * N + rows.to(tl.int64)  # [ROWS]
    mask3 = (row_mask[:, None] & block_mask[None, :])[:, :, None]
    packed = tl.load(codes_ptr + row_base[:, None, None] * KH + (ch // 2)[None, :, :], mask=mask3, other=0).to(tl.int32)
    nibble = tl.where((ch % 2 == 1)[None, :, :], packed >> 4, packed & 15)
    scale_bytes = tl.load(scales_ptr + row_base[:, None, None] * (KH // 8) + (ch // 16)[None, :, :], mask=mask3, other=0)
    decode = tl.load(ws2_ptr + expert)
    values = (e2m1_to_f32(nibble) * e4m3_to_f32(scale_bytes)) * decode  # dequantize's two roundings

    enc, dec, _unused = global_scales(tl.load(amax_ptr + expert))
    block_amax = tl.max(tl.abs(values), axis=2)  # [ROWS, SB]
    byte, scale = block_scale(block_amax, enc * RCP_6)
    encode = element_encode_scale(scale, dec)[:, :, None]
    codes = tl.reshape(e2m1_code(values * encode), [ROWS, SB, 8, 2])
    even, odd = tl.split(codes)
    new_bytes = even | (odd << 4)  # [ROWS, SB, 8]

    src = first // 16  # the copied block of q(W)
    copied = tl.load(codes_ptr + row_base[:, None, None] * KH + (src * 8)[None, :, None] + tl.arange(0, 8)[None, None, :],
                     mask=mask3 & aligned[None, :, None], other=0).to(tl.int32)
    copied_scale = tl.load(scales_ptr + row_base[:, None] * (KH // 8) + src[None, :],
                           mask=row_mask[:, None] & (block_mask & aligned)[None, :], other=0).to(tl.int32)
    out_bytes = tl.where(aligned[None, :, None], copied, new_bytes)
    out_scale = tl.where(aligned[None, :], copied_scale, byte)

    out_rows = row_base * (S // 2)
    tl.store(out_codes_ptr + out_rows[:, None, None] + (sblocks * 8)[None, :, None] + tl.arange(0, 8)[None, None, :],
             out_bytes.to(tl.uint8), mask=mask3)
    tl.store(out_scales_ptr + row_base[:, None] * (S // 16) + sblocks[None, :], out_scale.to(tl.uint8),
             mask=row_mask[:, None] & block_mask[None, :])


def reblock_columns_kernel(
    codes: torch.Tensor, scales: torch.Tensor, weight_scale_2: torch.Tensor, amax: torch.Tensor, channels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_S`` ``(codes uint8 [n, N, |S|/2], scales e4m3 [n, N, |S|/16])`` of a stacked NVFP4 weight
    (codes ``[n, N, K/2]``, scales ``[n, N, K/16]``, ``weight_scale_2`` and the recovered ``amax``
    ``[n]``) for sorted unique channels ``[n, |S|]``, |S| a multiple of 16."""
    n, rows, kh = codes.shape
    s = channels.shape[1]
    out_codes = torch.empty(n, rows, s // 2, dtype=torch.uint8, device=codes.device)
    out_scales = torch.empty(n, rows, s // 16, dtype=torch.uint8, device=codes.device)
    if n and rows and s:
        grid = (n * triton.cdiv(rows, _ROWS), triton.cdiv(s // 16, _SB))
        _reblock_kernel[grid](codes.contiguous(), scales.contiguous().view(torch.uint8),
                              weight_scale_2.contiguous().to(torch.float32), amax.contiguous().to(torch.float32),
                              channels.contiguous().to(torch.int32), out_codes, out_scales, rows, kh, s,
                              ROWS=_ROWS, SB=_SB, num_warps=4)
    return out_codes, out_scales.view(torch.float8_e4m3fn)
