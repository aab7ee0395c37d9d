"""Triton W4A4 NVFP4 linears with Residual Activation Compensation (RAC), dense and grouped (MoE).

Two kernels per linear, matching :mod:`megatron_quads.rollout.rac` / :mod:`megatron_quads.rollout.grouped`:

* the prologue (:func:`quantize_activations_kernel`) quantizes each token row to NVFP4, bit for bit
  as :func:`megatron_quads.nvfp4.quantize` does with the row's global amax, then quantizes the
  residual ``x - dq(q(x))`` of the RAC channels S with the same amax, and writes both parts into
  one augmented row of ``K + |S|`` codes;
* the GEMM (:func:`rac_linear_kernel`, :func:`grouped_rac_kernel`) dequantizes both operands tile by
  tile into fp16 (``e2m1 * e4m3`` is exact in fp16), accumulates ``tl.dot`` in fp32 over the
  augmented K (the weight's K columns, then W_S's |S| columns) and applies
  ``alpha = a_decode[row] * w_decode`` in the epilogue;
* or, the default (no ``GemmConfig``), the prologue (:func:`activation_block_values_kernel`) writes
  each row's bf16 block values (``e2m1 * e4m3``, exact) instead, and the W4A16 kernels
  (:func:`~megatron_quads.kernels.w4a16.w4a16_augmented_into`, ``grouped_w4a16_into``) reduce them
  against ``[W, W_S]`` in one pass with ``alpha`` per row: faster than the RAC GEMM at every size
  measured (``benchmarks/bench_kernels.py --only rac``; the rule is in
  :mod:`~megatron_quads.kernels.dispatch`).

Hopper has no FP4 tensor cores, so this emulation is the W4A4 path there. All exactness-critical
arithmetic uses IEEE divisions (``div_rn``) and bit manipulation, never fp8 casts, so the
interpreter and the GPU agree; the prologue is compiled without FMA contraction because the
residual ``x - (v * s) * ws2`` must round the product before the subtraction, as PyTorch does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from megatron_quads.nvfp4 import BLOCK_SIZE, NVFP4Tensor
from megatron_quads.nvfp4.format import SUPPORTED_DTYPES
from megatron_quads.nvfp4.triton_codec import (
    RCP_6,
    block_scale,
    e2m1_code,
    e2m1_to_f32,
    e4m3_to_f32,
    element_encode_scale,
    global_scales,
    round_f32_to,
    unpack_e2m1,
)
from megatron_quads.kernels.dispatch import X_ORDER_BLOCK_K
from megatron_quads.kernels.w4a16 import _X_ORDER_BLOCK, mma_k_order_position
from megatron_quads.nvfp4.activation import ActivationScale

# ----------------------------------------------------------------------------------------------
# Device functions
# ----------------------------------------------------------------------------------------------


@triton.jit
def _quantize_pairs(even, odd, encode_div6, decode):
    """Quantize fp32 blocks given as even/odd halves ``[NB, 8]``: ``(packed bytes, scale bytes [NB],
    fp32 scales [NB])``."""
    block_amax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))
    scale_byte, scale_f32 = block_scale(block_amax, encode_div6)
    encode = element_encode_scale(scale_f32, decode)[:, None]
    packed = e2m1_code(even * encode) | (e2m1_code(odd * encode) << 4)
    return packed, scale_byte, scale_f32


@triton.jit
def _store_values(values_row, even, packed, scale_f32, mask, K_ORDER: tl.constexpr):
    """The block values ``e2m1 * e4m3`` of ``packed`` codes (bf16, exact: at most 6 significant bits)
    at the even columns ``even [NB, 8]`` and the odd ones after them (``K_ORDER``: where
    :func:`~megatron_quads.kernels.w4a16.mma_k_order_rows` puts those columns in their
    128-column block, the order the W4A16 kernels' ``x_mma_order`` takes)."""
    scale = scale_f32[:, None]
    odd = even + 1
    if K_ORDER:
        even = mma_k_order_position(even, _X_ORDER_BLOCK)
        odd = mma_k_order_position(odd, _X_ORDER_BLOCK)
    tl.store(values_row + even, (e2m1_to_f32(packed & 15) * scale).to(tl.bfloat16), mask=mask)
    tl.store(values_row + odd, (e2m1_to_f32(packed >> 4) * scale).to(tl.bfloat16), mask=mask)


@triton.jit
def _residual_at(x_row, channel, mask, encode_div6, decode, ws2):
    """``x - dq(q(x))`` in fp32 at the int32 channel indices ``channel [NB, 8]`` of one row.

    Recomputes the scale of the 16-block holding each channel from a gather of that block (cache
    hits), so no program has to read back what it wrote. ``dq = (e2m1 * scale) * ws2``, as in
    :func:`megatron_quads.nvfp4.tensor.dequantize`; the caller compiles without FMA contraction.
    """
    x = tl.load(x_row + channel, mask=mask, other=0.0).to(tl.float32)
    first = (channel // 16) * 16
    block = tl.load(x_row + first[:, :, None] + tl.arange(0, 16)[None, None, :], mask=mask[:, :, None], other=0.0)
    _, scale_f32 = block_scale(tl.max(tl.abs(block.to(tl.float32)), axis=2), encode_div6)
    code = e2m1_code(x * element_encode_scale(scale_f32, decode))
    dq = (e2m1_to_f32(code) * scale_f32) * ws2
    return tl.where(mask, x - dq, 0.0)


@triton.jit
def _expert_of(row, offsets_ptr, num_experts, BLOCK_E: tl.constexpr):
    """The expert owning ``row``: how many experts end at or before it (``offsets[e + 1] <= row``)."""
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(offsets_ptr + 1 + e, mask=e < num_experts, other=2147483647)
    return tl.sum((ends <= row).to(tl.int32), axis=0)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, stride_xm,
    ch_ptr, stride_ch,
    amax_ptr, stride_amax,
    offsets_ptr, num_experts,
    codes_ptr, stride_cm,
    scales_ptr, stride_sm,
    decode_ptr,
    values_ptr, stride_vm,
    K: tl.constexpr, S: tl.constexpr,
    ROW_AMAX: tl.constexpr, GROUPED: tl.constexpr, VALUES: tl.constexpr,
    BLOCK_KB: tl.constexpr, BLOCK_SB: tl.constexpr, BLOCK_E: tl.constexpr, K_ORDER: tl.constexpr = False,
):
    """One token row: amax, NVFP4 codes/scales of x, then of the residual at the channels S; with
    ``VALUES`` instead the block values ``e2m1 * e4m3`` of both parts (bf16, without the row's
    ``weight_scale_2``) into one row of ``K + S`` values (``K_ORDER``: each part in the K order)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    codes_row = codes_ptr + row * stride_cm
    scales_row = scales_ptr + row * stride_sm
    values_row = values_ptr + row * stride_vm
    expert = 0
    if GROUPED:
        expert = _expert_of(row, offsets_ptr, num_experts, BLOCK_E)

    if ROW_AMAX:
        amax = tl.zeros((), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_KB * 16):
            k = k0 + tl.arange(0, BLOCK_KB * 16)
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    else:
        amax = tl.load(amax_ptr + expert * stride_amax)
    encode, decode, ws2 = global_scales(amax)
    encode_div6 = encode * RCP_6
    tl.store(decode_ptr + row, ws2)

    pair = tl.arange(0, 8)[None, :]
    for b0 in range(0, K // 16, BLOCK_KB):
        blocks = b0 + tl.arange(0, BLOCK_KB)
        bmask = blocks < K // 16
        mask = bmask[:, None]
        even = blocks[:, None] * 16 + 2 * pair
        xe = tl.load(x_row + even, mask=mask, other=0.0).to(tl.float32)
        xo = tl.load(x_row + even + 1, mask=mask, other=0.0).to(tl.float32)
        packed, scale_byte, scale_f32 = _quantize_pairs(xe, xo, encode_div6, decode)
        if not VALUES:
            tl.store(codes_row + blocks[:, None] * 8 + pair, packed.to(tl.uint8), mask=mask)
            tl.store(scales_row + blocks, scale_byte.to(tl.uint8), mask=bmask)
        else:
            _store_values(values_row, even, packed, scale_f32, mask, K_ORDER)

    ch_row = ch_ptr + expert * stride_ch
    for b0 in range(0, S // 16, BLOCK_SB):
        blocks = b0 + tl.arange(0, BLOCK_SB)
        bmask = blocks < S // 16
        mask = bmask[:, None] & (pair < 8)
        even = blocks[:, None] * 16 + 2 * pair
        ch_even = tl.load(ch_row + even, mask=mask, other=0)
        ch_odd = tl.load(ch_row + even + 1, mask=mask, other=0)
        re = _residual_at(x_row, ch_even, mask, encode_div6, decode, ws2)
        ro = _residual_at(x_row, ch_odd, mask, encode_div6, decode, ws2)
        packed, scale_byte, scale_f32 = _quantize_pairs(re, ro, encode_div6, decode)
        if not VALUES:
            tl.store(codes_row + K // 2 + blocks[:, None] * 8 + pair, packed.to(tl.uint8), mask=mask)
            tl.store(scales_row + K // 16 + blocks, scale_byte.to(tl.uint8), mask=bmask)
        else:
            _store_values(values_row + K, even, packed, scale_f32, mask, K_ORDER)


@triton.jit
def _dequant_tile(codes_ptr, scales_ptr, rows, row_mask, stride_c, stride_s, b0, num_bytes,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Exact fp16 block values of ``BLOCK_K`` elements from byte ``b0`` on: ``(even, odd)``, each ``[R, BK/2]``.

    Codes and scales are loaded as contiguous rows (so both can be vectorized and pipelined); the
    scale of block ``j`` is broadcast to its 8 bytes in registers. fp16 holds every ``e2m1 * e4m3``
    product exactly (at most 6 significant bits, magnitudes 2^-10..2688, all fp16 normals); bf16
    would too, but Triton's interpreter mis-evaluates bf16 ``tl.dot``.
    """
    byte = b0 + tl.arange(0, BLOCK_K // 2)
    mask = row_mask[:, None] & (byte < num_bytes)[None, :]
    packed = tl.load(codes_ptr + rows[:, None] * stride_c + byte[None, :], mask=mask, other=0)
    block = b0 // 8 + tl.arange(0, BLOCK_K // 16)
    scale_mask = row_mask[:, None] & (block < num_bytes // 8)[None, :]
    scale_byte = tl.load(scales_ptr + rows[:, None] * stride_s + block[None, :], mask=scale_mask, other=0)
    scale = e4m3_to_f32(scale_byte)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_R, BLOCK_K // 16, 8)), (BLOCK_R, BLOCK_K // 2))
    low, high = unpack_e2m1(packed)
    return (low * scale).to(tl.float16), (high * scale).to(tl.float16)


@triton.jit
def _accumulate(acc, a_codes, a_scales, a_rows, a_mask, stride_am, stride_asm,
                w_codes, w_scales, w_rows, w_mask, stride_wn, stride_wsn,
                num_bytes: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr):
    """``acc += A[:, range] @ W[:, range]^T`` over ``num_bytes`` packed bytes (2 elements each).

    ``a_codes`` / ``w_codes`` (and the scale pointers) already point at the first byte (scale) of
    the range. Even and odd elements go through two dots: any consistent permutation of K gives the
    same products, and it avoids interleaving the nibbles. With ``SWAP_AB`` the accumulator is
    ``[BLOCK_N, BLOCK_M]`` so a small token count sits in the MMA's N slot.
    """
    for b0 in range(0, num_bytes, BLOCK_K // 2):
        a_even, a_odd = _dequant_tile(a_codes, a_scales, a_rows, a_mask, stride_am, stride_asm, b0, num_bytes,
                                      BLOCK_M, BLOCK_K)
        w_even, w_odd = _dequant_tile(w_codes, w_scales, w_rows, w_mask, stride_wn, stride_wsn, b0, num_bytes,
                                      BLOCK_N, BLOCK_K)
        if SWAP_AB:
            acc = tl.dot(w_even, tl.trans(a_even), acc)
            acc = tl.dot(w_odd, tl.trans(a_odd), acc)
        else:
            acc = tl.dot(a_even, tl.trans(w_even), acc)
            acc = tl.dot(a_odd, tl.trans(w_odd), acc)
    return acc


@triton.jit
def _tile_rows(pid_m, offsets_ptr, num_experts, T,
               GROUPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """``(expert, first row, row end)`` of M tile ``pid_m``; ``first >= end`` marks an unused tile.

    Grouped: each expert's rows are cut into its own tiles, numbered expert after expert; the
    tile -> expert map is a prefix sum over the offsets, computed in every program (no host sync).
    """
    if GROUPED:
        e = tl.arange(0, BLOCK_E)
        emask = e < num_experts
        lo = tl.load(offsets_ptr + e, mask=emask, other=0)
        hi = tl.load(offsets_ptr + 1 + e, mask=emask, other=0)
        tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(tiles, axis=0)
        expert = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
        mine = e == expert
        first_tile = tl.sum(tl.where(mine, ends - tiles, 0), axis=0)
        start = tl.sum(tl.where(mine, lo, 0), axis=0) + (pid_m - first_tile) * BLOCK_M
        end = tl.sum(tl.where(mine, hi, 0), axis=0)  # 0 past the last expert: the tile is unused
    else:
        expert = 0
        start = pid_m * BLOCK_M
        end = T
    return expert, start, end


@triton.jit
def _rac_gemm_kernel(
    a_codes, a_scales, a_decode, stride_am, stride_asm,
    w_codes, w_scales, stride_we, stride_wn, stride_wse, stride_wsn,
    r_codes, r_scales, stride_re, stride_rn, stride_rse, stride_rsn,
    w_decode, stride_wd,
    out_ptr, stride_om, stride_on,
    offsets_ptr, num_experts,
    T, N, K: tl.constexpr, S: tl.constexpr,
    GROUPED: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """``out[rows, cols] = ([qx, qr_S] @ [qW, W_S]^T) * a_decode[row] * w_decode[expert]``."""
    pid_m = tl.program_id(0)  # axis 0 (no 65535 limit) for M tiles, which grow with the token count
    pid_n = tl.program_id(1)
    expert, start, end = _tile_rows(pid_m, offsets_ptr, num_experts, T, GROUPED, BLOCK_M, BLOCK_E)
    if start >= end:
        return
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    rows64 = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    cols64 = cols.to(tl.int64)
    e64 = expert.to(tl.int64)

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _accumulate(acc, a_codes, a_scales, rows64, row_mask, stride_am, stride_asm,
                      w_codes + e64 * stride_we, w_scales + e64 * stride_wse, cols64, col_mask,
                      stride_wn, stride_wsn, K // 2, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB)
    if S > 0:
        acc = _accumulate(acc, a_codes + K // 2, a_scales + K // 16, rows64, row_mask, stride_am, stride_asm,
                          r_codes + e64 * stride_re, r_scales + e64 * stride_rse, cols64, col_mask,
                          stride_rn, stride_rsn, S // 2, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB)

    alpha = tl.load(a_decode + rows64, mask=row_mask, other=0.0) * tl.load(w_decode + e64 * stride_wd)
    if SWAP_AB:
        y = acc * alpha[None, :]
        ptrs = out_ptr + rows64[None, :] * stride_om + cols64[:, None] * stride_on
        mask = row_mask[None, :] & col_mask[:, None]
    else:
        y = acc * alpha[:, None]
        ptrs = out_ptr + rows64[:, None] * stride_om + cols64[None, :] * stride_on
        mask = row_mask[:, None] & col_mask[None, :]
    tl.store(ptrs, round_f32_to(y, out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch parameters of the RAC GEMM."""

    block_m: int
    block_n: int
    block_k: int
    swap_ab: bool
    num_warps: int
    num_stages: int


def gemm_config(rows_per_group: int) -> GemmConfig:
    """Tiles for ``rows_per_group`` tokens per GEMM (per expert when grouped; an average there).

    Decode-sized M uses swap-AB with 16-token tiles (the weight's N fills the MMA's M slot);
    larger M uses square-ish tiles. A starting point, to be tuned on the target GPU.
    """
    if rows_per_group <= 16:
        return GemmConfig(16, 64, 128, True, 4, 4)
    if rows_per_group <= 32:
        return GemmConfig(32, 64, 128, True, 4, 4)
    if rows_per_group <= 64:
        return GemmConfig(64, 128, 64, False, 4, 3)
    return GemmConfig(128, 128, 64, False, 8, 3)


def _check_activations(x2d: torch.Tensor) -> None:
    if x2d.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"activations must be bfloat16, float16 or float32, got {x2d.dtype}")
    if x2d.ndim != 2 or x2d.shape[1] == 0 or x2d.shape[1] % BLOCK_SIZE:
        raise ValueError(f"activations must be [tokens, K] with K a non-zero multiple of 16, got {tuple(x2d.shape)}")


def _channels_2d(channels: torch.Tensor | None, groups: int, device: torch.device) -> torch.Tensor:
    """Channel sets as int32 ``[groups, S]`` on ``device`` (a 1-D set is shared by every group)."""
    if channels is None:
        return torch.zeros(groups, 0, dtype=torch.int32, device=device)
    ch = channels.to(device=device, dtype=torch.int32)
    if ch.ndim == 1:
        ch = ch.unsqueeze(0).expand(groups, -1)
    if ch.ndim != 2 or ch.shape[0] != groups or ch.shape[1] % BLOCK_SIZE:
        raise ValueError(f"channels must be [S] or [{groups}, S] with S a multiple of 16, got {tuple(channels.shape)}")
    return ch.contiguous()


def _padded_rows(rows: int, width: int, device: torch.device) -> torch.Tensor:
    """uint8 ``[rows, width]`` whose row stride is a multiple of 16 bytes, so the GEMM's loads of it
    are aligned (Triton specializes 16-divisible strides: vectorized, pipelined copies)."""
    stride = triton.cdiv(width, 16) * 16
    return torch.empty(rows, stride, dtype=torch.uint8, device=device)[:, :width]


def _amax_source(
    x2d: torch.Tensor,
    mode: ActivationScale,
    static_amax: float | torch.Tensor | None,
    expert_offsets: torch.Tensor | None,
) -> torch.Tensor | None:
    """The fp32 amax each row reads when it is not the row's own: ``[1]`` or one per expert ``[E]``.

    PER_TENSOR over grouped rows is per expert, as the reference quantizes each expert's rows alone.
    """
    if mode == ActivationScale.PER_TOKEN:
        return None
    if mode == ActivationScale.STATIC:
        if static_amax is None:
            raise ValueError("ActivationScale.STATIC needs a calibrated static_amax (input_scale * 2688)")
        amax = torch.as_tensor(static_amax, dtype=torch.float32, device=x2d.device)
        if amax.numel() != 1:
            raise ValueError(f"static_amax must be one value, got shape {tuple(amax.shape)}")
        return amax.reshape(1)
    row_amax = x2d.abs().amax(dim=1).to(torch.float32)
    if expert_offsets is None:
        return row_amax.amax().reshape(1)
    num_experts = expert_offsets.numel() - 1
    rows = torch.arange(x2d.shape[0], device=x2d.device, dtype=torch.int32)
    expert = torch.searchsorted(expert_offsets[1:], rows, right=True).clamp_(max=num_experts - 1)
    amax = torch.zeros(num_experts, dtype=torch.float32, device=x2d.device)
    return amax.scatter_reduce_(0, expert, row_amax, "amax")


def _prologue_rows(
    x2d: torch.Tensor,
    mode: ActivationScale,
    channels: torch.Tensor | None,
    expert_offsets: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Checked prologue inputs: ``(channels [groups, S] int32, expert_offsets int32 or None, K + S)``;
    an unknown ``mode`` fails here, before any buffer is allocated."""
    _check_activations(x2d)
    ActivationScale(mode)
    if expert_offsets is not None:
        expert_offsets = expert_offsets.to(device=x2d.device, dtype=torch.int32).contiguous()
    groups = expert_offsets.numel() - 1 if expert_offsets is not None else 1
    ch = _channels_2d(channels, groups, x2d.device)
    return ch, expert_offsets, x2d.shape[1] + ch.shape[1]


def _launch_prologue(
    x2d: torch.Tensor,
    ch: torch.Tensor,
    mode: ActivationScale,
    static_amax: float | torch.Tensor | None,
    expert_offsets: torch.Tensor | None,
    decode: torch.Tensor,
    codes_and_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    values: torch.Tensor | None = None,
    k_order: bool = False,
) -> None:
    """One program per row of ``x2d``: codes and scales into ``codes_and_scales``, or block values into
    ``values`` (``k_order``: in the W4A16 kernels' K order)."""
    rows, k = x2d.shape
    if rows == 0:
        return
    x2d = x2d if x2d.stride(1) == 1 else x2d.contiguous()
    amax = _amax_source(x2d, ActivationScale(mode), static_amax, expert_offsets)
    codes, scales = codes_and_scales if codes_and_scales is not None else (decode, decode)  # placeholders when VALUES
    values = decode if values is None else values  # placeholder when not VALUES
    grouped = expert_offsets is not None
    _quantize_rows_kernel[(rows,)](
        x2d, x2d.stride(0),
        ch, ch.stride(0),
        decode if amax is None else amax, 0 if amax is None or amax.numel() == 1 else 1,
        expert_offsets if grouped else decode, ch.shape[0],
        codes, codes.stride(0),
        scales, scales.stride(0),
        decode,
        values, values.stride(0),
        k, ch.shape[1],
        ROW_AMAX=amax is None, GROUPED=grouped, VALUES=codes_and_scales is None,
        BLOCK_KB=min(64, triton.next_power_of_2(k // BLOCK_SIZE)),
        BLOCK_SB=min(16, triton.next_power_of_2(max(ch.shape[1] // BLOCK_SIZE, 1))),
        BLOCK_E=triton.next_power_of_2(ch.shape[0] + 1),
        K_ORDER=k_order,
        enable_fp_fusion=False,
        num_warps=4,
    )


def quantize_activations_kernel(
    x2d: torch.Tensor,
    channels: torch.Tensor | None,
    mode: ActivationScale = ActivationScale.PER_TOKEN,
    static_amax: float | torch.Tensor | None = None,
    expert_offsets: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The RAC prologue: ``(a_codes uint8 [T, (K+S)/2], a_scales uint8 (e4m3 bits) [T, (K+S)/16], a_decode fp32 [T])``.

    Row t holds ``q(x[t])`` followed by ``q(r[t, S])`` with ``r = x - dq(q(x))``, both quantized with
    the row's global amax (``mode``), byte-identical to :func:`megatron_quads.nvfp4.quantize`.
    ``channels`` is ``[S]`` (or None), or ``[E, S]`` with ``expert_offsets [E + 1]`` (tokens sorted by
    expert). ``out`` optionally supplies the three output buffers.
    Inputs are not checked for NaN/Inf and channel values are not range-checked (that would need a host sync).
    """
    ch, offsets, width = _prologue_rows(x2d, mode, channels, expert_offsets)
    rows = x2d.shape[0]
    if out is None:
        out = (
            _padded_rows(rows, width // 2, x2d.device),
            _padded_rows(rows, width // BLOCK_SIZE, x2d.device),
            torch.empty(rows, dtype=torch.float32, device=x2d.device),
        )
    codes, scales, decode = out
    if codes.shape != (rows, width // 2) or scales.shape != (rows, width // BLOCK_SIZE) or decode.shape != (rows,):
        raise ValueError("out buffers do not match [T, (K+S)/2], [T, (K+S)/16], [T]")
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8 or decode.dtype != torch.float32 or min(
        codes.stride(1), scales.stride(1), decode.stride(0)
    ) != 1:
        raise ValueError("out buffers must be uint8, uint8 and float32 with unit stride along the last dim")
    _launch_prologue(x2d, ch, mode, static_amax, offsets, decode, codes_and_scales=(codes, scales))
    return codes, scales, decode


def activation_block_values_kernel(
    x2d: torch.Tensor,
    channels: torch.Tensor | None,
    mode: ActivationScale = ActivationScale.PER_TOKEN,
    static_amax: float | torch.Tensor | None = None,
    expert_offsets: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    k_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prologue for the W4A16 kernels: ``(values bf16 [T, K+S], a_decode fp32 [T])``.

    Quantizes as :func:`quantize_activations_kernel` (same arguments) but writes each row's block
    values ``e2m1 * e4m3`` instead of its codes and scales: exact in bf16, and times ``a_decode``
    they are the dequantized augmented activations ``[dq(q(x)), dq(q(r_S))]``. ``out`` optionally
    supplies both buffers. ``k_order`` writes each part in the K order of 128-column blocks
    (``mma_k_order_rows(values, 128)``, what ``grouped_w4a16_into(..., x_mma_order=True)`` takes;
    K and S multiples of 128).
    """
    ch, offsets, width = _prologue_rows(x2d, mode, channels, expert_offsets)
    if k_order and (x2d.shape[1] % X_ORDER_BLOCK_K or ch.shape[1] % X_ORDER_BLOCK_K):
        raise ValueError(f"k_order needs K and the RAC channel count multiples of {X_ORDER_BLOCK_K}, got K="
                         f"{x2d.shape[1]}, S={ch.shape[1]}")
    rows = x2d.shape[0]
    if out is None:
        out = (torch.empty(rows, width, dtype=torch.bfloat16, device=x2d.device),
               torch.empty(rows, dtype=torch.float32, device=x2d.device))
    values, decode = out
    if (values.shape != (rows, width) or values.dtype != torch.bfloat16 or values.stride(1) != 1
            or decode.shape != (rows,) or decode.dtype != torch.float32 or decode.stride(0) != 1):
        raise ValueError(f"out must be a bfloat16 [{rows}, {width}] tensor with unit stride along the last dim and a "
                         f"float32 [{rows}] one, got {values.dtype} {tuple(values.shape)} and {decode.dtype} {tuple(decode.shape)}")
    _launch_prologue(x2d, ch, mode, static_amax, offsets, decode, values=values, k_order=k_order)
    return values, decode


def _scales_u8(t: NVFP4Tensor) -> torch.Tensor:
    return t.scales.view(torch.uint8)


def _launch_gemm(
    act: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    weight: NVFP4Tensor,
    residual_weight: NVFP4Tensor | None,
    out: torch.Tensor,
    expert_offsets: torch.Tensor | None,
    config: GemmConfig,
) -> None:
    """Run the augmented-K GEMM on prologue outputs ``act`` into ``out [T, N]`` (2-D or 3-D weights)."""
    codes, scales, decode = act
    rows = codes.shape[0]
    grouped = expert_offsets is not None
    num_experts = weight.shape[0] if grouped else 1
    n, k = weight.shape[-2], weight.shape[-1]
    s = 2 * codes.shape[1] - k
    w_codes, w_scales = weight.codes.contiguous(), _scales_u8(weight).contiguous()
    if s:
        assert residual_weight is not None
        r_codes, r_scales = residual_weight.codes.contiguous(), _scales_u8(residual_weight).contiguous()
    else:
        r_codes, r_scales = w_codes, w_scales  # never read
    w_decode = weight.weight_scale_2.to(device=codes.device, dtype=torch.float32).reshape(-1)
    if w_decode.numel() not in (1, num_experts):
        raise ValueError(f"weight_scale_2 must hold 1 or {num_experts} values, got shape {tuple(weight.weight_scale_2.shape)}")
    cfg = config
    m_tiles = triton.cdiv(rows, cfg.block_m) + (min(rows, num_experts) if grouped else 0)
    grid = (m_tiles, triton.cdiv(n, cfg.block_n))

    def expert_stride(t: torch.Tensor) -> int:
        return t.stride(0) if grouped else 0  # a 2-D weight is one expert

    _rac_gemm_kernel[grid](
        codes, scales, decode, codes.stride(0), scales.stride(0),
        w_codes, w_scales, expert_stride(w_codes), w_codes.stride(-2), expert_stride(w_scales), w_scales.stride(-2),
        r_codes, r_scales, expert_stride(r_codes), r_codes.stride(-2), expert_stride(r_scales), r_scales.stride(-2),
        w_decode, 1 if w_decode.numel() > 1 else 0,
        out, out.stride(0), out.stride(1),
        expert_offsets if grouped else decode, num_experts,
        rows, n, k, s,
        GROUPED=grouped, SWAP_AB=cfg.swap_ab,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_E=triton.next_power_of_2(num_experts + 1),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _output_buffer(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {like.dtype} tensor of shape {shape}, got {tuple(out.shape)} {out.dtype}")
    return out


def _check_residual(weight_shape: tuple[int, ...], channels: torch.Tensor, residual_weight: NVFP4Tensor | None) -> None:
    s = channels.shape[-1]
    if s == 0:
        return
    if residual_weight is None:
        raise ValueError("RAC channels are set but the residual weight W_S is missing")
    expected = (*weight_shape[:-1], s)
    if tuple(residual_weight.shape) != expected:
        raise ValueError(f"residual weight must have shape {expected}, got {tuple(residual_weight.shape)}")


def rac_linear_kernel(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    channels: torch.Tensor | None,
    residual_weight: NVFP4Tensor | None,
    mode: ActivationScale = ActivationScale.PER_TOKEN,
    static_amax: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """W4A4 linear with RAC as one augmented-K GEMM (:func:`megatron_quads.rollout.rac.rac_linear`).

    ``x [..., K]``, ``weight [N, K]``, ``channels`` int ``[S]`` (empty or None: plain W4A4, then
    ``residual_weight`` may be None), ``residual_weight [N, S]`` sharing the weight's decode scale.
    Returns ``[..., N]`` in ``x.dtype`` (written into ``out`` when given). Without ``config`` the
    W4A16 kernels run over the prologue's block values; a ``config`` (e.g. :func:`gemm_config`) runs
    the RAC GEMM with those tiles.
    """
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x must be [..., {k}], got shape {tuple(x.shape)}")
    ch = _channels_2d(channels, 1, x.device)
    _check_residual(tuple(weight.shape), ch, residual_weight)
    y = _output_buffer(out, (*x.shape[:-1], n), x)
    x2d = x.reshape(-1, k)
    rows = x2d.shape[0]
    if rows == 0:
        return y
    if config is None:
        # the prologue writes the bf16 block values of [q(x), q(r_S)] and the W4A16 split-K
        # kernel reduces them against [W, W_S] in one pass, alpha per row in its epilogue
        from megatron_quads.kernels.w4a16 import w4a16_augmented_into

        values, decode = activation_block_values_kernel(x2d, ch[0], mode, static_amax)
        w4a16_augmented_into(values, weight, residual_weight if ch.shape[1] else None, decode, y.view(-1, n))
        return y
    act = quantize_activations_kernel(x2d, ch[0], mode, static_amax)
    _launch_gemm(act, weight, residual_weight, y.view(-1, n), None, config)
    return y


TAIL_PAD_MAX_GROWTH = 1.25
"""Most growth of the reduction (``K + S``) that widening the RAC tail to the warp-specialized
kernel's ring step may cost (a chosen bound): the grouped W4A4 + RAC call then runs on that kernel
rather than the Triton one. At the down projection (K 768) it covers S = 96, 192 and 384 (growth
1.19, 1.07, 1.11), not S = 16; there the widened call is faster than the Triton path at S 96 and
192 (``benchmarks/bench_kernels.py --only rac_ws``, docs/kernels.md). The widened ``W_S`` takes the
place of the narrow one (Qwen3-30B-A3B down at S 96: 37.7 MB a layer instead of 14.2)."""


def padded_tail(channels: torch.Tensor, residual_weight: NVFP4Tensor,
                width: int) -> tuple[torch.Tensor, NVFP4Tensor]:
    """RAC channels ``[E, S]`` and ``W_S [E, N, S]`` widened to ``width`` columns without changing
    the product: the added channels repeat the last one (finite block values), and ``W_S``'s added
    columns are zero codes with zero block scales, so each adds exact zeros to the reduction. The
    widened tensors are new (they alias none of the inputs)."""
    s = channels.shape[1]
    pad = width - s
    if pad < 0 or pad % BLOCK_SIZE or s == 0:
        raise ValueError(f"can widen a non-empty tail of {s} channels to a larger multiple of {BLOCK_SIZE}, not {width}")
    if pad == 0:
        return channels, residual_weight
    wide_channels = torch.cat([channels, channels[:, -1:].expand(-1, pad)], dim=1).contiguous()
    codes = torch.nn.functional.pad(residual_weight.codes, (0, pad // 2))
    scales = torch.nn.functional.pad(_scales_u8(residual_weight), (0, pad // BLOCK_SIZE)).view(residual_weight.scales.dtype)
    return wide_channels, replace(residual_weight, codes=codes, scales=scales,
                                  shape=torch.Size((*residual_weight.shape[:-1], width)))


def prepare_rac_tail(channels: torch.Tensor, residual_weight: NVFP4Tensor, in_features: int,
                     device: torch.device) -> tuple[torch.Tensor, NVFP4Tensor]:
    """The RAC tail (``channels [E, S]``, ``W_S [E, N, S]`` of a grouped weight with ``in_features``
    columns) as :func:`grouped_rac_kernel` should be given it on ``device``: widened
    (:func:`padded_tail`) to the warp-specialized grouped kernel's ring step where that kernel takes
    the call there and the reduction ``K + S`` grows by at most :data:`TAIL_PAD_MAX_GROWTH`; otherwise
    (another device, no tail, a tail already whole steps) the inputs themselves. Run once when the
    weights load or move, not per call: the widened ``W_S`` is a copy."""
    from megatron_quads.kernels.dispatch import warp_specialized_tail_width

    s = channels.shape[-1]
    width = warp_specialized_tail_width(torch.device(device), in_features, s) if s else 0
    if width > s and in_features + width <= TAIL_PAD_MAX_GROWTH * (in_features + s):
        return padded_tail(channels, residual_weight, width)
    return channels, residual_weight


def grouped_rac_kernel(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    expert_offsets: torch.Tensor,
    channels: torch.Tensor | None = None,
    residual_weight: NVFP4Tensor | None = None,
    mode: ActivationScale = ActivationScale.PER_TOKEN,
    static_amax: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Grouped W4A4 (+ RAC) over tokens sorted by expert (:func:`megatron_quads.rollout.grouped.grouped_rac_linear`).

    ``x [T, K]``, stacked ``weight [E, N, K]`` (``weight_scale_2`` ``[E]``, ``[E, 1]`` or shared),
    ``expert_offsets`` int ``[E + 1]`` on x's device, ``channels [E, S]`` and ``residual_weight
    [E, N, S]`` (both or neither). No host sync: the grid depends on T and E only, and tiles past
    the routed tokens exit at once. Returns ``[T, N]`` in ``x.dtype``; ``config`` as in
    :func:`rac_linear_kernel` (``gemm_config`` of the mean rows per expert gives the RAC GEMM's
    usual tiles). The tail is used as given: :func:`prepare_rac_tail` puts it in the width this
    device runs best.
    """
    from megatron_quads.nvfp4.stacked import check_grouped_shapes

    check_grouped_shapes(x, weight, expert_offsets)
    num_experts, n, _ = weight.shape
    if (channels is None) != (residual_weight is None):
        raise ValueError("grouped RAC needs both channels [E, S] and residual_weight [E, N, S], or neither")
    ch = _channels_2d(channels, num_experts, x.device)
    _check_residual(tuple(weight.shape), ch, residual_weight)
    y = _output_buffer(out, (x.shape[0], n), x)
    if x.shape[0] == 0:
        return y
    offsets = expert_offsets.to(device=x.device, dtype=torch.int32).contiguous()
    if config is None:
        # the grouped W4A16 kernel over the prologue's bf16 block values
        from megatron_quads.kernels.dispatch import warp_specialized_grouped
        from megatron_quads.kernels.w4a16 import grouped_w4a16_into

        # the block values in the warp-specialized kernel's K order where it takes the call (a tail
        # from prepare_rac_tail is whole ring steps there wherever widening it costs little)
        tail = residual_weight if ch.shape[1] else None
        k_order = warp_specialized_grouped(x.device, weight.shape[-1], ch.shape[1]) is not None
        values, decode = activation_block_values_kernel(x, ch, mode, static_amax, offsets, k_order=k_order)
        grouped_w4a16_into(values, weight, offsets, y, tail=tail, row_scale=decode, x_mma_order=k_order)
        return y
    act = quantize_activations_kernel(x, ch, mode, static_amax, offsets)
    _launch_gemm(act, weight, residual_weight if ch.shape[1] else None, y, offsets, config)
    return y
