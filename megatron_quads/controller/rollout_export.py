"""What each trainer rank sends to the rollout engines: its part of the weights in the wire format.

One sender per expert-parallel rank (``trainer.hf_export.weight_sender``). Each sends its EP rank's
routed experts, stacked per layer and quantized on its own device (``rollout.wire``); sender 0
(global rank 0) also sends every other tensor. No rank gathers another EP rank's experts.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron_quads.rollout.wire import encode_wire, is_stack_name
from megatron_quads.trainer.hf_export import export_rollout_parts, weight_sender

PRECISIONS = ("bf16", "nvfp4")


def export_rollout_tensors(
    model: torch.nn.Module | list[torch.nn.Module],
    precision: str,
    dtype: torch.dtype,
    residual_channels: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor] | None:
    """This rank's wire payload (``precision`` "nvfp4": routed experts quantized; "bf16": all in
    ``dtype``), or None on a rank that sends nothing. Collective: every trainer rank calls it in step.

    ``residual_channels``: see :func:`megatron_quads.rollout.wire.encode_wire`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"rollout weight precision must be one of {PRECISIONS}, got {precision!r}")
    sender = weight_sender()
    parts = export_rollout_parts(model)
    if sender is None:
        for _ in parts:  # take part in every gather, keep nothing
            pass
        return None
    kept = ((n, t) for n, t in parts if sender[0] == 0 or is_stack_name(n))
    return encode_wire(kept, quantized=precision == "nvfp4", dtype=dtype, residual_channels=residual_channels)
