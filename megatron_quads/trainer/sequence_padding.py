"""Padding a batch's sequence dimension to the length Megatron-Core's sequence parallelism needs.

Under sequence parallelism (which MoE with TP > 1 requires) the embedding's output is scattered
over the tensor-parallel ranks along the sequence (``scatter_to_sequence_parallel_region``), which
asserts that the sequence length is a multiple of the TP size. Batches arrive padded only to their
longest sequence, so the policy worker pads each forward with :func:`pad_to_multiple` and trims the
logits back to :attr:`PaddedBatch.length`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_quads.trainer.router_replay import NOT_ROUTED


class PaddedBatch(NamedTuple):
    """A batch padded by :func:`pad_to_multiple`."""

    tokens: torch.Tensor
    """``[b, s_padded]``."""
    routed_experts: torch.Tensor | None
    """``[b, s_padded, layers, k]``, or None when none was given."""
    padding_mask: torch.Tensor | None
    """``[b, s_padded]`` bool, True at the added positions (Megatron's ``padding_mask``); None when
    nothing was added."""
    length: int
    """The real sequence length ``s``: keep ``logits[:, :length]``."""


def pad_to_multiple(tokens: torch.Tensor, multiple: int, routed_experts: torch.Tensor | None = None) -> PaddedBatch:
    """Pad ``tokens [b, s]`` (and ``routed_experts [b, s, layers, k]``) at the end of the sequence
    dimension to the next multiple of ``multiple``.

    The rule: positions are appended after each sequence's last one, never before, so under causal
    attention (and dropless, per-token MoE) every real position computes exactly what it computes
    unpadded; the caller keeps ``logits[:, :length]``. An added position repeats the sequence's last
    token and gets :data:`NOT_ROUTED` experts (the routers replay a fixed filler for it, and
    :class:`~megatron_quads.trainer.router_replay.RoutingAgreement` does not count it); the returned
    ``padding_mask`` marks it so Megatron's MoE load-balancing statistics leave it out. Nothing is
    copied when ``s`` already is a multiple (``padding_mask`` is then None).
    """
    if multiple < 1:
        raise ValueError(f"the padding multiple must be at least 1, got {multiple}")
    b, s = tokens.shape
    if s == 0:
        raise ValueError("cannot pad an empty sequence dimension: the batch has no positions")
    extra = -s % multiple
    if extra == 0:
        return PaddedBatch(tokens, routed_experts, None, s)
    padded_tokens = torch.cat([tokens, tokens[:, -1:].expand(b, extra)], dim=1)
    padded_routing = None
    if routed_experts is not None:
        filler = routed_experts.new_full((b, extra, *routed_experts.shape[2:]), NOT_ROUTED)
        padded_routing = torch.cat([routed_experts, filler], dim=1)
    padding_mask = torch.zeros(b, s + extra, dtype=torch.bool, device=tokens.device)
    padding_mask[:, s:] = True
    return PaddedBatch(padded_tokens, padded_routing, padding_mask, s)
