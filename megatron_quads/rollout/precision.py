"""Precision modes of the linears in scope, shared by the analysis tools and the built-in rollout engine.

| precision | output of a linear with input x |
|---|---|
| ``bf16``  | ``x W^T`` |
| ``aqat``  | ``x q(W)^T`` (the QUADS trainer; as a rollout: W4A16) |
| ``w4a4``  | ``q(x) q(W)^T`` (naive NVFP4 rollout) |
| ``quads`` | ``[q(x), q(r_S)] [q(W), W_S]^T`` (W4A4 + RAC at a ratio) |
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_quads.nvfp4 import NVFP4Tensor
from megatron_quads.rollout.rac import rac_linear
from megatron_quads.rollout.w4a4 import w4a4_linear

PRECISIONS = ("bf16", "aqat", "w4a4", "quads")


@dataclass(frozen=True)
class Precision:
    """How one side computes the linears in scope (``ratio`` only for ``quads``)."""

    kind: str
    ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in PRECISIONS:
            raise ValueError(f"unknown precision {self.kind!r}; choose one of {PRECISIONS}")

    @property
    def label(self) -> str:
        """A short name for tables and plots."""
        return f"quads@{self.ratio:.3g}" if self.kind == "quads" else self.kind


@dataclass
class LinearState:
    """What a precision needs of one linear: its dense weight, quantized weight and RAC channels."""

    weight: torch.Tensor
    quantized: NVFP4Tensor
    channels: dict[float, torch.Tensor] = field(default_factory=dict)
    residual: dict[float, NVFP4Tensor] = field(default_factory=dict)


def replace_output(result: object, y: torch.Tensor) -> object:
    """A module's forward result with its output tensor replaced (Megatron linears return tuples)."""
    return (y, *result[1:]) if isinstance(result, tuple) else y


def linear_output(x: torch.Tensor, state: LinearState, precision: Precision) -> torch.Tensor:
    """The linear's output under ``precision`` for input ``x [..., K]``, in x's dtype."""
    if precision.kind == "bf16":
        return (x.float() @ state.weight.float().t()).to(x.dtype)
    if precision.kind == "aqat":
        return (x.float() @ state.quantized.dequantize(torch.float32).t()).to(x.dtype)
    if precision.kind == "w4a4":
        return w4a4_linear(x, state.quantized)
    channels = state.channels[precision.ratio]
    return rac_linear(x, state.quantized, channels, state.residual.get(precision.ratio))
