"""The global amax behind a stored decode scale: NVFP4 weights store ``weight_scale_2 = amax / 2688``
and not the amax, so re-quantizing part of a stored weight with its global scale first recovers an
fp32 amax whose quotient is that decode scale exactly."""

from __future__ import annotations

import torch

from megatron_quads.nvfp4.format import GLOBAL_SCALE_DIVISOR
from megatron_quads.nvfp4.quantize import decode_scale_from_amax

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
