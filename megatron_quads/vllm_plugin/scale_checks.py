"""The load-time check of the NVFP4 scales a vLLM layer holds, for the MoE and linear methods.

The rule is :mod:`megatron_quads.rollout.stored_scales` (the project's checkpoint reader applies the
same): block scales finite and >= 0, ``weight_scale_2`` finite and >= 0 and 0 only for an all-zero
weight, static input scales finite and > 0. A layer's parameters stack several checkpoint tensors
(experts, fused shards): every check is reduced to one flag per *slot* (one checkpoint tensor), all
flags are read back in one host sync, and the first bad slot is named as its checkpoint tensor.
This module imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_quads.rollout.stored_scales import invalid_block_scales, invalid_decode_scales, invalid_input_scales

_DAMAGED = "the checkpoint is damaged or was not written by an NVFP4 quantizer: re-export it"


@dataclass(frozen=True)
class _Check:
    leaf: str
    invalid: torch.Tensor  # bool [..., S]: one flag per slot
    detail: torch.Tensor  # [..., S]: the scalar (decode / input scales) or the count of bad block scales


def _per_slot(rows: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``[..., N, B]`` -> ``[..., S]``: the sum over each slot's rows (slot ``s`` holds ``sizes[s]`` rows)."""
    return torch.stack([part.sum(dim=(-2, -1)) for part in rows.split(list(sizes), dim=-2)], dim=-1)


class ScaleChecks:
    """The scale checks of one layer whose slots hold ``sizes`` rows each (gate/up, q/k/v; one slot
    for an unfused weight); ``name(index, leaf)`` is the checkpoint tensor of slot ``index``."""

    def __init__(self, sizes: Sequence[int], name: Callable[[tuple[int, ...], str], str]) -> None:
        self.sizes, self.name = list(sizes), name
        self._checks: list[_Check] = []

    def weight(self, scales: torch.Tensor, scale_2: torch.Tensor) -> None:
        """A weight's block scales ``[..., N, K/16]`` and its decode scales ``[..., S]``."""
        bad = _per_slot(invalid_block_scales(scales).to(torch.int32), self.sizes)
        nonzero = _per_slot(scales.view(torch.uint8).ne(0).to(torch.int32), self.sizes) > 0
        self._checks.append(_Check("weight_scale_2", invalid_decode_scales(scale_2, nonzero), scale_2))
        self._checks.append(_Check("weight_scale", bad > 0, bad))

    def residual(self, scales: torch.Tensor) -> None:
        """The block scales ``[..., N, C/16]`` of ``W_S``."""
        if scales.numel():
            bad = _per_slot(invalid_block_scales(scales).to(torch.int32), self.sizes)
            self._checks.append(_Check("residual_weight_scale", bad > 0, bad))

    def input_scale(self, scale: torch.Tensor) -> None:
        """Static input scales ``[..., S]``."""
        self._checks.append(_Check("input_scale", invalid_input_scales(scale), scale))

    def raise_first(self) -> None:
        """ValueError naming the first checkpoint tensor that breaks the rule (one host sync)."""
        if not self._checks:
            return
        flags = torch.stack([c.invalid.any() for c in self._checks]).tolist()
        for check, bad in zip(self._checks, flags, strict=True):
            if not bad:
                continue
            index = tuple(int(i) for i in torch.nonzero(check.invalid)[0].tolist())
            name, detail = self.name(index, check.leaf), check.detail[index]
            if check.leaf == "weight_scale_2" and float(detail) == 0:
                raise ValueError(f"{name} is 0 but its weight_scale holds non-zero block scales: the weight would "
                                 f"compute zeros (only an all-zero weight has weight_scale_2 = 0); {_DAMAGED}")
            if check.leaf in ("weight_scale_2", "input_scale"):
                bound = "> 0" if check.leaf == "input_scale" else ">= 0"
                raise ValueError(f"{name} is {float(detail)}; it must be finite and {bound}: {_DAMAGED}")
            raise ValueError(f"{name} holds {int(detail)} NaN or negative block scales (float8_e4m3fn bytes 0x7F / "
                             f"0xFF or a sign bit); NVFP4 block scales are finite and >= 0: {_DAMAGED}")
