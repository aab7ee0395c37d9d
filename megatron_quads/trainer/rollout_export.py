"""Which trainer ranks send rollout weights, and what each sends (the wire format of ``rollout.wire``).

One sender per expert-parallel rank: the rank with expert-tensor-parallel rank 0 and expert-data-
parallel rank 0 of that EP rank's group (sender index = EP rank). Each sends its EP rank's routed
experts, stacked per layer and quantized on its own device; sender 0 (global rank 0) also sends
every other tensor. No rank gathers another EP rank's experts.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from megatron.core import parallel_state

from megatron_quads.rollout.expert_stacks import ExpertStack
from megatron_quads.rollout.wire import encode_wire
from megatron_quads.trainer.hf_export import export_rollout_parts

PRECISIONS = ("bf16", "nvfp4")


def weight_sender() -> tuple[int, int] | None:
    """(this rank's sender index, number of senders) when this rank sends rollout weights, else None."""
    if parallel_state.get_expert_tensor_parallel_rank() or parallel_state.get_expert_data_parallel_rank():
        return None
    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


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
    keep_dense = sender is not None and sender[0] == 0
    parts = export_rollout_parts(model)
    if sender is None:
        for _ in parts:  # take part in every gather, keep nothing
            pass
        return None
    kept = (p for p in parts if keep_dense or isinstance(p, ExpertStack))
    return encode_wire(kept, quantized=precision == "nvfp4", dtype=dtype, residual_channels=residual_channels)
