"""The per-tensor level of NVFP4: the global amax and the encode / decode scales derived from it,
shared by the PyTorch reference and the Triton kernels, and the global amax behind a stored decode
scale: NVFP4 weights store ``weight_scale_2 = amax / 2688`` and not the amax, so re-quantizing part
of a stored weight with its global scale first recovers an fp32 amax whose quotient is that decode
scale exactly."""

from __future__ import annotations

import torch

from megatron_quads.nvfp4.format import FLOAT32_MAX, GLOBAL_SCALE_DIVISOR
from megatron_quads.nvfp4.validation import describe_tensor

AmaxLike = float | torch.Tensor | None
"""A caller's global amax: None (take ``max(|x|)``), a number, or a tensor of one amax per leading index."""


def compute_global_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor amax, fp32 0-dim: ``max(|x|)`` over every element."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().amax().to(torch.float32)


def global_amax_tensor(global_amax: AmaxLike, x: torch.Tensor) -> torch.Tensor:
    """The fp32 amax to quantize ``x`` with: ``max(|x|)`` for None, else ``global_amax``, which must
    be finite, ``>= 0`` and broadcast against ``x.shape[:-1]``."""
    if global_amax is None:
        return compute_global_amax(x)
    amax = torch.as_tensor(global_amax, dtype=torch.float32, device=x.device)
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise ValueError(f"global_amax must be finite and >= 0, got {amax} for a {describe_tensor(x)}")
    try:
        torch.broadcast_shapes(amax.shape, x.shape[:-1])
    except RuntimeError as err:
        raise ValueError(
            f"global_amax of shape {tuple(amax.shape)} does not broadcast against the leading dims "
            f"{tuple(x.shape[:-1])} of a {describe_tensor(x)}: pass a scalar, or one amax per leading index"
        ) from err
    return amax


def global_encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = 2688 / amax`` in fp32, capped at FLT_MAX (so amax 0 gives FLT_MAX); 1 where it is 0.

    As in TE, only a zero quotient (amax = inf, which validation rejects) falls back to 1; a zero
    amax gives FLT_MAX, harmless because every block scale and code of such a tensor is 0.
    """
    divisor = torch.tensor(GLOBAL_SCALE_DIVISOR, dtype=torch.float32, device=global_amax.device)
    encode = torch.clamp(torch.div(divisor, global_amax), max=FLOAT32_MAX)
    return torch.where(encode == 0, torch.ones_like(encode), encode)


def decode_scale_from_amax(global_amax: torch.Tensor) -> torch.Tensor:
    """``weight_scale_2 = amax / 2688`` in fp32 (the per-tensor decode scale stored in checkpoints).

    A tensor divisor on purpose: CUDA turns division by a Python scalar into multiplication by its
    rounded reciprocal, which rounds differently from the true quotient that CPU computes.
    """
    amax = global_amax.to(torch.float32)
    return torch.div(amax, torch.full_like(amax, GLOBAL_SCALE_DIVISOR))


_CANDIDATE_ULPS = 4  # the rounded product is within an ulp or two of an exact preimage


def global_amax_from_decode_scale(weight_scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element of ``weight_scale_2`` (any shape, one decode scale per tensor or per expert), an
    fp32 amax with ``decode_scale_from_amax(amax) == weight_scale_2`` exactly, and a bool flag that is
    True where no fp32 amax has that quotient (a damaged scale).

    The rule: try ``weight_scale_2 * 2688``, then the fp32 values 1, 2, 3, 4 ulps above and below it
    (up before down at each distance), and take the first that is finite, >= 0 and reproduces the
    decode scale. Reads nothing to the host.
    """
    ws2 = weight_scale_2.to(torch.float32)
    guess = ws2 * torch.tensor(GLOBAL_SCALE_DIVISOR, dtype=torch.float32, device=ws2.device)
    candidates, up, down = [guess], guess, guess
    for _ in range(_CANDIDATE_ULPS):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        candidates += [up, down]
    stacked = torch.stack(candidates, dim=-1)
    ok = torch.isfinite(stacked) & (stacked >= 0) & (decode_scale_from_amax(stacked) == ws2.unsqueeze(-1))
    first = ok.to(torch.int8).argmax(dim=-1, keepdim=True)
    return stacked.gather(-1, first).squeeze(-1), ~ok.any(dim=-1)
