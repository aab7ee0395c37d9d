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

WEIGHT_FORMATS = ("bf16", "nvfp4")
"""What the routed experts are sent as (``Precision.weight_format``)."""


def export_rollout_tensors(
    model: torch.nn.Module | list[torch.nn.Module],
    weight_format: str,
    dtype: torch.dtype,
    residual_channels: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor] | None:
    """This rank's wire payload (``weight_format`` "nvfp4": routed experts quantized; "bf16": all in
    ``dtype``), or None on a rank that sends nothing. Collective: every trainer rank calls it in step.

    ``residual_channels``: see :func:`megatron_quads.rollout.wire.encode_wire`.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"rollout weight format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    sender = weight_sender()
    parts = export_rollout_parts(model)
    if sender is None:
        for _ in parts:  # take part in every gather, keep nothing
            pass
        return None
    kept = ((n, t) for n, t in parts if sender[0] == 0 or is_stack_name(n))
    return encode_wire(kept, quantized=weight_format == "nvfp4", dtype=dtype, residual_channels=residual_channels)
