"""The sequence padding the policy worker applies under sequence parallelism (``pad_to_multiple``)."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.trainer.router_replay import NOT_ROUTED
from megatron_quads.trainer.sequence_padding import pad_to_multiple


def _routing(b: int, s: int, layers: int = 2, k: int = 2) -> torch.Tensor:
    return torch.randint(0, 4, (b, s, layers, k), generator=torch.Generator().manual_seed(0)).to(torch.int16)


def test_an_odd_batch_is_padded_at_the_end_to_the_next_multiple() -> None:
    tokens = torch.arange(3 * 17).view(3, 17)
    routing = _routing(3, 17)
    padded = pad_to_multiple(tokens, 4, routing)
    assert padded.length == 17
    assert padded.tokens.shape == (3, 20) and padded.routed_experts.shape == (3, 20, 2, 2)
    assert torch.equal(padded.tokens[:, :17], tokens)
    assert torch.equal(padded.tokens[:, 17:], tokens[:, -1:].expand(3, 3))  # the last token repeated
    assert torch.equal(padded.routed_experts[:, :17], routing)
    assert (padded.routed_experts[:, 17:] == NOT_ROUTED).all()
    assert padded.routed_experts.dtype == routing.dtype
    assert padded.padding_mask.dtype == torch.bool
    assert not padded.padding_mask[:, :17].any() and padded.padding_mask[:, 17:].all()


def test_a_length_already_a_multiple_is_returned_as_it_is() -> None:
    tokens, routing = torch.zeros(2, 12, dtype=torch.long), _routing(2, 12)
    padded = pad_to_multiple(tokens, 2, routing)
    assert padded.tokens is tokens and padded.routed_experts is routing
    assert padded.padding_mask is None and padded.length == 12
    assert pad_to_multiple(torch.zeros(2, 17, dtype=torch.long), 1).padding_mask is None


def test_without_routing_only_the_tokens_are_padded() -> None:
    padded = pad_to_multiple(torch.ones(2, 5, dtype=torch.long), 2)
    assert padded.tokens.shape == (2, 6) and padded.routed_experts is None and padded.length == 5


@pytest.mark.parametrize("multiple", [0, -2])
def test_a_multiple_below_one_is_refused(multiple: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        pad_to_multiple(torch.zeros(1, 3, dtype=torch.long), multiple)


def test_an_empty_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        pad_to_multiple(torch.zeros(2, 0, dtype=torch.long), 2)
