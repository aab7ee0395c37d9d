"""``W_S``: the columns S of a stored NVFP4 weight, re-blocked into 1x16 NVFP4 blocks along S.

RAC appends ``W_S`` to the weight along the reduction dimension, so it must share the weight's
global scale. The rule: gather the channels S (sorted ascending) of ``q(W)``; each block of 16
gathered channels that is exactly one block of ``q(W)`` (16 consecutive channels starting at a
multiple of 16) is copied, code and scale bytes; every other block is the NVFP4 quantization of
the gathered columns of ``dequantize(q(W))`` with the global amax recovered from ``weight_scale_2``
(:func:`~megatron_quads.nvfp4.global_scale.global_amax_from_decode_scale`). So ``W_S`` is a function
of the stored fields and S only, and equals ``q(W)`` byte for byte when S is every channel.

One weight ``[N, K]`` takes channels ``[|S|]``; a stack of experts ``[n, N, K]`` takes channels
``[n, |S|]`` (each expert its own set, one count). On CUDA one Triton kernel
(:mod:`megatron_quads.nvfp4.reblock_kernel`) does it, byte-identical to the reference here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_quads.nvfp4.backend import use_kernels
from megatron_quads.nvfp4.format import BLOCK_SIZE, e2m1_lut
from megatron_quads.nvfp4.global_scale import global_amax_from_decode_scale
from megatron_quads.nvfp4.stacked import quantize_experts
from megatron_quads.nvfp4.tensor import NVFP4Tensor

_PACKED_BLOCK = BLOCK_SIZE // 2  # bytes of packed codes per 16-element block


def check_channels(channels: torch.Tensor, in_features: int, where: str = "residual channels") -> None:
    """Raise ValueError (naming ``where``) unless ``channels`` is a channel set W_S can be built for:
    a 1-D integer tensor, sorted ascending, unique, inside ``[0, in_features)``, its count a multiple
    of 16 (W_S and the residual activation are NVFP4 tensors of 16-element blocks). Reads the values
    on the host."""
    if channels.dtype == torch.bool or channels.is_floating_point() or channels.is_complex():
        raise ValueError(f"{where} must be an integer tensor of channel indices, got dtype {channels.dtype}")
    if channels.ndim != 1:
        raise ValueError(f"{where} must be 1-D, got shape {tuple(channels.shape)}")
    ch = channels.to(torch.int64)
    n = ch.numel()
    if n % BLOCK_SIZE:
        raise ValueError(
            f"{where} holds {n} channels; the count must be a multiple of {BLOCK_SIZE} (W_S and q(r_S) are "
            f"NVFP4 tensors of {BLOCK_SIZE}-element blocks): round the selection, e.g. rac.num_residual_channels"
        )
    if n > in_features:
        raise ValueError(f"{where} holds {n} channels but the weight has only K={in_features} input channels")
    if not n:
        return
    low, high = int(ch.min()), int(ch.max())
    if low < 0 or high >= in_features:
        pos = int(torch.nonzero((ch < 0) | (ch >= in_features))[0])
        raise ValueError(f"{where}[{pos}] = {int(ch[pos])} is outside [0, K={in_features}): channels index input features")
    step = ch[1:] - ch[:-1]
    if bool((step <= 0).any()):
        pos = int(torch.nonzero(step <= 0)[0])
        a, b = int(ch[pos]), int(ch[pos + 1])
        if a == b:
            raise ValueError(f"{where} repeats channel {a} (positions {pos} and {pos + 1}); channels must be unique")
        raise ValueError(
            f"{where} is not sorted ascending: channel {b} at position {pos + 1} follows {a}; "
            "sort it (torch.sort) before passing it"
        )


def check_channel_rows(channels: torch.Tensor, in_features: int, where: Callable[[int], str]) -> None:
    """:func:`check_channels` for every row of ``channels [R, |S|]`` (e.g. one projection's experts) with
    one host read for all of them: the values are checked on their device, and only a row that fails is
    checked again on its own, for its error (``where(row)`` names it)."""
    if channels.ndim != 2:
        raise ValueError(f"expected channel sets [rows, |S|], got shape {tuple(channels.shape)}")
    if not channels.shape[0] or not channels.shape[1]:
        for row in range(channels.shape[0]):  # no values to read: the dtype and count checks
            check_channels(channels[row], in_features, where(row))
        return
    ch = channels.to(torch.int64)
    bad = ((ch < 0) | (ch >= in_features)).any(dim=1) | (ch[:, 1:] <= ch[:, :-1]).any(dim=1)
    if channels.dtype == torch.bool or channels.is_floating_point() or channels.is_complex() \
            or channels.shape[1] % BLOCK_SIZE or channels.shape[1] > in_features or bool(bad.any()):
        first = int(torch.nonzero(bad)[0]) if bool(bad.any()) else 0
        check_channels(channels[first], in_features, where(first))


def reblock_columns(weight: NVFP4Tensor, channels: torch.Tensor) -> NVFP4Tensor:
    """``W_S`` of ``weight`` for ``channels`` (the module rule), as an NVFP4 tensor ``[..., N, |S|]``
    sharing ``weight``'s ``weight_scale_2``. Checks every channel set (:func:`check_channels`) and
    raises ValueError when a ``weight_scale_2`` is ``amax / 2688`` for no fp32 amax (a damaged scale);
    both read values on the host."""
    _check_ranks(weight, channels)
    if channels.ndim == 2:
        check_channel_rows(channels, weight.shape[-1], lambda row: f"residual channels of expert {row}")
    else:
        check_channels(channels, weight.shape[-1])
    residual, no_amax = reblock_columns_deferred(weight, channels)
    if bool(no_amax.any()):
        bad = weight.weight_scale_2.reshape(-1)[no_amax.reshape(-1)][0] if no_amax.ndim else weight.weight_scale_2
        raise ValueError(f"weight_scale_2 = {float(bad)!r} is not amax / 2688 for any fp32 amax; the scale is damaged")
    return residual


def reblock_columns_deferred(weight: NVFP4Tensor, channels: torch.Tensor) -> tuple[NVFP4Tensor, torch.Tensor]:
    """``W_S`` as :func:`reblock_columns` builds it, without reading anything on the host: the
    channels must already be valid sets (sorted, unique, inside ``[0, K)``, a multiple of 16), and a
    damaged ``weight_scale_2`` is returned as a flag instead of raised: ``(W_S, no_amax)``, ``no_amax``
    bool, one per decode scale, True where its expert's ``W_S`` is meaningless."""
    _check_ranks(weight, channels)
    stacked = len(weight.shape) == 3
    codes = weight.codes if stacked else weight.codes.unsqueeze(0)
    scales = weight.scales if stacked else weight.scales.unsqueeze(0)
    ch = channels if stacked else channels.unsqueeze(0)
    n, rows, k = codes.shape[0], codes.shape[1], 2 * codes.shape[2]
    s = ch.shape[1]
    ws2 = weight.weight_scale_2.to(torch.float32).reshape(-1)
    if ws2.numel() == 1 and n > 1:
        ws2 = ws2.expand(n)
    device = codes.device
    if s == 0:
        out_codes = torch.zeros(n, rows, 0, dtype=torch.uint8, device=device)
        out_scales = torch.zeros(n, rows, 0, dtype=torch.float8_e4m3fn, device=device)
        no_amax = torch.zeros(weight.weight_scale_2.shape, dtype=torch.bool, device=weight.weight_scale_2.device)
    else:
        amax, no_amax = global_amax_from_decode_scale(weight.weight_scale_2)
        amax = amax.reshape(-1).expand(n) if amax.numel() == 1 else amax.reshape(n)
        if use_kernels(codes):
            from megatron_quads.nvfp4.reblock_kernel import reblock_columns_kernel

            out_codes, out_scales = reblock_columns_kernel(codes, scales, ws2, amax, ch.to(device=device))
        else:
            out_codes, out_scales = _reblock_reference(codes, scales, ws2, amax, ch.to(device=device, dtype=torch.int64))
    if not stacked:
        out_codes, out_scales = out_codes[0], out_scales[0]
    residual = NVFP4Tensor(
        codes=out_codes,
        scales=out_scales,
        weight_scale_2=weight.weight_scale_2,
        shape=torch.Size((*weight.shape[:-1], s)),
        dtype=weight.dtype,
    )
    return residual, no_amax


def _check_ranks(weight: NVFP4Tensor, channels: torch.Tensor) -> None:
    stacked = len(weight.shape) == 3
    if len(weight.shape) not in (2, 3) or channels.ndim != len(weight.shape) - 1:
        raise ValueError(
            f"W_S is built from a 2-D [N, K] weight with channels [|S|] or a stacked [n, N, K] weight with channels "
            f"[n, |S|], got weight {tuple(weight.shape)} and channels {tuple(channels.shape)}"
        )
    if stacked and channels.shape[0] != weight.shape[0]:
        raise ValueError(f"channels must be [experts={weight.shape[0]}, |S|], got {tuple(channels.shape)}")


def _reblock_reference(codes: torch.Tensor, scales: torch.Tensor, weight_scale_2: torch.Tensor, amax: torch.Tensor,
                       channels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The module rule in PyTorch for stacked fields ``[n, N, K/2]``, ``[n, N, K/16]``, ``[n]``, ``[n]``
    and int64 channels ``[n, |S|]``."""
    n, rows, kh = codes.shape
    s = channels.shape[1]
    blocks = channels.view(n, s // BLOCK_SIZE, BLOCK_SIZE)
    first = blocks[..., 0]
    # channels are sorted and unique, so 16 of them spanning 15 are consecutive
    aligned = (first % BLOCK_SIZE == 0) & (blocks[..., -1] - first == BLOCK_SIZE - 1)  # [n, S/16]
    # the copied blocks
    source = (first // BLOCK_SIZE)[:, None, :].expand(n, rows, -1)
    code_blocks = codes.view(n, rows, kh // _PACKED_BLOCK, _PACKED_BLOCK)
    copied_codes = code_blocks.gather(2, source[..., None].expand(-1, -1, -1, _PACKED_BLOCK))
    copied_scales = scales.view(torch.uint8).gather(2, source)

    # the re-quantized blocks: dequantize(q(W))[..., S] exactly as dequantize computes it
    # (indices are broadcast views over the rows: nothing [n, N, |S|]-sized is built for them)
    def over_rows(index: torch.Tensor) -> torch.Tensor:
        return index[:, None, :].expand(n, rows, s)

    packed = codes.gather(2, over_rows(channels // 2))
    nibbles = torch.where(over_rows(channels % 2 == 1), packed >> 4, packed & 0xF)
    values = e2m1_lut(codes.device)[nibbles.to(torch.int32)]
    block_values = values * scales.to(torch.float32).gather(2, over_rows(channels // BLOCK_SIZE))
    gathered = block_values * weight_scale_2.reshape(n, 1, 1)
    requant = quantize_experts(gathered, amax)
    keep = aligned[:, None, :]
    out_codes = torch.where(keep[..., None], copied_codes, requant.codes.view(n, rows, -1, _PACKED_BLOCK))
    out_scales = torch.where(keep, copied_scales, requant.scales.view(torch.uint8))
    return out_codes.reshape(n, rows, s // 2), out_scales.view(torch.float8_e4m3fn)
