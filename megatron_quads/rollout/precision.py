"""The linears in scope computed under a :class:`~megatron_quads.precision.Precision`, shared by the
analysis tools and the built-in rollout engine.

| ``precision.kind`` | output of a linear with input x |
|---|---|
| ``bf16``  | ``x W^T`` |
| ``w4a16`` | ``x q(W)^T`` (also the AQAT trainer's forward) |
| ``w4a4``  | ``q(x) q(W)^T`` (naive NVFP4 rollout) |
| ``quads`` | ``[q(x), q(r_S)] [q(W), W_S]^T`` (W4A4 + RAC at a ratio) |
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megatron_quads.nvfp4 import NVFP4Tensor
from megatron_quads.precision import Precision
from megatron_quads.rollout.rac import rac_linear
from megatron_quads.rollout.w4a4 import w4a16_linear, w4a4_linear


@dataclass
class LinearState:
    """One linear as the NVFP4 precisions compute it: its quantized weight and, per RAC ratio, the
    residual channels and their residual weight ``W_S`` (``None`` where there are no channels)."""

    quantized: NVFP4Tensor
    channels: dict[float, torch.Tensor] = field(default_factory=dict)
    residual: dict[float, NVFP4Tensor | None] = field(default_factory=dict)

    @property
    def in_features(self) -> int:
        """K of the weight ``[N, K]``."""
        return self.quantized.shape[-1]


def replace_output(result: object, y: torch.Tensor) -> object:
    """A module's forward result with its output tensor replaced (Megatron linears return tuples)."""
    return (y, *result[1:]) if isinstance(result, tuple) else y


def linear_output(x: torch.Tensor, state: LinearState, precision: Precision) -> torch.Tensor:
    """The linear's output under an NVFP4 ``precision`` for input ``x [..., K]``, in x's dtype."""
    if not precision.quantized_rollout:
        raise ValueError("bf16 computes with the unquantized weight, which a LinearState does not hold")
    if precision.kind == "w4a16":
        return w4a16_linear(x, state.quantized)
    if precision.kind == "w4a4":
        return w4a4_linear(x, state.quantized)
    channels = state.channels[precision.ratio]
    return rac_linear(x, state.quantized, channels, state.residual.get(precision.ratio))


class QuantizedLinear(nn.Module):
    """A linear held as NVFP4 (and its RAC tails) only: ``forward(x)`` is :func:`linear_output` of
    ``state`` under ``precision``. It has no parameters; ``state`` is set when weights load."""

    def __init__(self, precision: Precision, state: LinearState | None = None) -> None:
        super().__init__()
        self.precision = precision
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The output for ``x [..., K]`` in x's dtype."""
        if self.state is None:
            raise RuntimeError("this quantized linear holds no weights yet: load them first")
        return linear_output(x, self.state, self.precision)
