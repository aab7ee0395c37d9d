"""Grouped (MoE) NVFP4 linear references over tokens sorted by expert (CPU)."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.nvfp4 import NVFP4Tensor, quantize
from megatron_quads.rollout.grouped import (
    expert_offsets_from_counts,
    expert_weight,
    grouped_rac_linear,
    grouped_w4a16_linear,
)
from megatron_quads.rollout.rac import rac_linear, reblock_columns, select_channels

E, N, K = 4, 24, 64


def _stacked_weight() -> NVFP4Tensor:
    w = torch.randn(E, N, K) * torch.tensor([0.01, 0.1, 1.0, 10.0]).view(E, 1, 1)  # per-expert scales differ
    return quantize(w, global_amax=w.abs().amax(dim=(1, 2)).unsqueeze(1))


def test_offsets_are_cumulative_counts() -> None:
    assert expert_offsets_from_counts(torch.tensor([3, 0, 5, 2])).tolist() == [0, 3, 3, 8, 10]


def test_grouped_w4a16_equals_a_per_token_gather_of_the_dequantized_stack() -> None:
    weight = _stacked_weight()
    counts = torch.tensor([3, 0, 6, 1])
    x = torch.randn(int(counts.sum()), K)
    expert_of_row = torch.repeat_interleave(torch.arange(E), counts)
    dense = weight.dequantize(torch.float32)  # [E, N, K], each expert with its own weight_scale_2
    expected = torch.einsum("tk,tnk->tn", x, dense[expert_of_row])
    y = grouped_w4a16_linear(x, weight, expert_offsets_from_counts(counts))
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_grouped_rac_uses_each_experts_channels_and_residual_weight() -> None:
    weight = _stacked_weight()
    counts = torch.tensor([2, 4, 0, 3])
    offsets = expert_offsets_from_counts(counts)
    x = torch.randn(int(counts.sum()), K)
    channels = torch.stack([select_channels(torch.rand(K), 0.25) for _ in range(E)])
    parts = [reblock_columns(expert_weight(weight, e), channels[e]) for e in range(E)]
    residual = NVFP4Tensor(codes=torch.stack([p.codes for p in parts]), scales=torch.stack([p.scales for p in parts]),
                           weight_scale_2=weight.weight_scale_2, shape=torch.Size((E, N, channels.shape[1])), dtype=weight.dtype)
    y = grouped_rac_linear(x, weight, offsets, channels, residual)
    plain = grouped_rac_linear(x, weight, offsets)
    for e in range(E):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        if rows.stop > rows.start:
            expected = rac_linear(x[rows], expert_weight(weight, e), channels[e], parts[e])
            assert torch.equal(y[rows], expected)
    assert not torch.equal(y, plain)  # the residual pass changes the result


@pytest.mark.parametrize(
    ("offsets", "pattern"),
    [([0, 3, 2, 5, 6], "rise from 0"), ([0, 1, 2, 3, 5], "rise from 0 to the token count 6"), ([0, 6], r"shape \[5\]")],
)
def test_bad_offsets_are_rejected_with_the_reason(offsets: list[int], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        grouped_w4a16_linear(torch.randn(6, K), _stacked_weight(), torch.tensor(offsets, dtype=torch.int32))
