"""Grouped (MoE) NVFP4 linear references over tokens sorted by expert (CPU)."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.nvfp4 import NVFP4Tensor, quantize
from megatron_quads.nvfp4.reblock import reblock_columns
from megatron_quads.rollout.grouped import (
    combine_routed_rows,
    expert_offsets_from_counts,
    expert_weight,
    grouped_rac_linear,
    grouped_w4a16_linear,
    kernel_x_order,
)
from megatron_quads.rollout.rac import rac_linear, select_channels

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


def test_x_in_the_kernel_order_is_refused_off_the_kernel_path() -> None:
    """The reference path takes x in its natural K order only (CPU here: no kernel, no block)."""
    x = torch.randn(6, K)
    assert kernel_x_order(x, rows_per_expert=64) is None
    offsets = expert_offsets_from_counts(torch.tensor([1, 2, 0, 3]))
    for order in ({"x_mma_order": True}, {"y_mma_order": True}):
        with pytest.raises(ValueError, match="needs the grouped W4A16 kernel"):
            grouped_w4a16_linear(x, _stacked_weight(), offsets, **order)


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_combine_reference_is_index_add_into_the_output(weights_dtype: torch.dtype) -> None:
    """On the CPU the combine's definition (fp32 sum in row order, one rounding) is what the layer
    did before: ``index_add_`` of the weighted rows into a zero bf16 output, within bf16 rounding
    of the exact sum."""
    torch.manual_seed(0)
    tokens, top_k, hidden = 40, 4, 96
    index = torch.rand(tokens, 16).topk(top_k, dim=1).indices
    order = torch.argsort(index.reshape(-1), stable=True)
    y = (torch.randn(tokens * top_k, hidden) * torch.exp2(torch.randint(-10, 10, (tokens * top_k, hidden)).float())).bfloat16()
    weights = torch.rand(tokens, top_k).to(weights_dtype)
    combined = combine_routed_rows(y, order, weights, torch.bfloat16)
    before = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    before.index_add_(0, order // top_k, (y * weights.reshape(-1)[order, None]).to(torch.bfloat16))
    assert torch.equal(combined, before)
    exact = torch.zeros(tokens, hidden, dtype=torch.float64).index_add_(
        0, order // top_k, y.double() * weights.reshape(-1)[order, None].double())
    assert (combined.double() - exact).abs().max() <= 2 ** -6 * exact.abs().max()


def _grouped_experts(precision: str, hidden: int, ffn: int, experts: int, device: str):
    from megatron_quads.precision import Precision
    from megatron_quads.rollout.grouped_experts import GroupedExperts, GroupedProjection

    def stack(n: int, k: int) -> NVFP4Tensor:
        w = torch.randn(experts, n, k, device=device) * 0.05
        return quantize(w, global_amax=w.abs().amax(dim=(1, 2)).unsqueeze(1))

    kind = Precision(precision)
    return GroupedExperts(GroupedProjection(kind, stack(2 * ffn, hidden)), GroupedProjection(kind, stack(hidden, ffn)))


@pytest.mark.gpu
def test_grouped_experts_with_x_in_the_kernel_order_match_the_natural_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA with bf16 activations the W4A16 layer puts the tokens' rows in the kernel's K order
    before the gather, and gate/up writes the down projection's input in it; its output is the
    natural-order kernels' within fp32 summation order (the two paths run different kernels and tiles)."""
    from megatron_quads.kernels import dispatch

    torch.manual_seed(0)
    layer = _grouped_experts("w4a16", hidden=256, ffn=128, experts=8, device="cuda")
    hidden = torch.randn(80, 256, device="cuda", dtype=torch.bfloat16)
    top_k_index = torch.rand(80, 8, device="cuda").topk(2, dim=1).indices  # 20 rows an expert
    top_k_weights = torch.rand(80, 2, device="cuda")
    below = dispatch.X_ORDER_MIN_ROWS_PER_EXPERT / 2
    assert layer.gate_up.input_order(hidden, 20) == 128 and layer.gate_up.input_order(hidden, below) is None
    assert layer._down_input_in_kernel_order(hidden, 20) and not layer._down_input_in_kernel_order(hidden, below)
    ordered = layer(hidden, top_k_index, top_k_weights, torch.nn.functional.silu)
    monkeypatch.setattr(dispatch, "X_ORDER_MIN_ROWS_PER_EXPERT", 1 << 30)
    assert layer.gate_up.input_order(hidden, 20) is None and not layer._down_input_in_kernel_order(hidden, 20)
    natural = layer(hidden, top_k_index, top_k_weights, torch.nn.functional.silu)
    torch.testing.assert_close(ordered.float(), natural.float(), rtol=2e-2, atol=2e-2 * float(natural.abs().max()))
    assert not torch.equal(ordered, torch.zeros_like(ordered))


@pytest.mark.gpu
def test_grouped_experts_forward_is_cuda_graph_capturable() -> None:
    """The W4A16 layer's forward (routing counts, gather, both kernels in their K orders, scatter)
    has no host synchronisation, so it captures into a CUDA graph, whose replay on new inputs
    gives the eager result."""
    torch.manual_seed(0)
    layer = _grouped_experts("w4a16", hidden=256, ffn=128, experts=8, device="cuda")
    hidden = torch.randn(80, 256, device="cuda", dtype=torch.bfloat16)
    top_k_index = torch.rand(80, 8, device="cuda").topk(2, dim=1).indices
    top_k_weights = torch.rand(80, 2, device="cuda")

    def forward() -> torch.Tensor:
        return layer(hidden, top_k_index, top_k_weights, torch.nn.functional.silu)

    forward()  # autotuning and compilation outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
    hidden.copy_(torch.randn_like(hidden))
    top_k_index.copy_(torch.rand(80, 8, device="cuda").topk(2, dim=1).indices)
    graph.replay()
    torch.testing.assert_close(captured, forward(), rtol=0, atol=0)


def _projection_from_parameters(precision: str, n: int, k: int, channels_count: int, device: str, seed: int):
    """A projection built as the vLLM plugin builds one from its stacked parameters: the decode scale
    out of an ``[E, 2]`` gate/up parameter, the channels out of an ``[E, 2, C]`` one, then prepared."""
    from megatron_quads.rollout.grouped_experts import GroupedProjection
    from megatron_quads.precision import Precision

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(E, n, k, generator=gen) * 0.05
    stacked = quantize(w, global_amax=w.abs().amax(dim=(1, 2)).unsqueeze(1))
    scale_2 = stacked.weight_scale_2.reshape(E, 1).expand(E, 2).contiguous().to(device)  # the [E, 2] parameter
    weight = NVFP4Tensor(codes=stacked.codes.to(device), scales=stacked.scales.to(device),
                         weight_scale_2=scale_2[:, 0].contiguous(), shape=stacked.shape, dtype=torch.bfloat16)
    kind = Precision(precision, 0.25 if precision == "quads" else 0.0)
    if precision != "quads":
        projection = GroupedProjection(kind, weight)
    else:
        chosen = torch.stack([torch.randperm(k, generator=gen)[:channels_count].sort().values for _ in range(E)]).to(torch.int32)
        parts = [reblock_columns(expert_weight(stacked, e), chosen[e]) for e in range(E)]
        residual = NVFP4Tensor(codes=torch.stack([p.codes for p in parts]).to(device),
                               scales=torch.stack([p.scales for p in parts]).to(device),
                               weight_scale_2=weight.weight_scale_2, shape=torch.Size((E, n, channels_count)),
                               dtype=torch.bfloat16)
        channel_parameter = chosen[:, None, :].expand(E, 2, channels_count).contiguous().to(device)  # [E, 2, C]
        projection = GroupedProjection(kind, weight, channel_parameter[:, 0].contiguous(), residual)
    projection.prepare()
    return projection


@pytest.mark.parametrize("precision", ["w4a16", "w4a4", "quads"])
def test_projections_without_states_prepare_and_compute_on_cpu(precision: str) -> None:
    """The vLLM plugin's projections hold no per-expert states: preparing one points nothing and
    the layer computes."""
    from megatron_quads.rollout.grouped_experts import GroupedExperts

    layer = GroupedExperts(_projection_from_parameters(precision, 128, 64, 32, "cpu", seed=1),
                           _projection_from_parameters(precision, 64, 64, 16, "cpu", seed=2))
    assert layer.gate_up.states == () and layer.down.states == ()
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    top_k_index = torch.rand(12, E, generator=torch.Generator().manual_seed(4)).topk(2, dim=1).indices
    y = layer(x, top_k_index, torch.rand(12, 2), torch.nn.functional.silu)
    assert y.shape == (12, 64) and torch.isfinite(y.float()).all() and float(y.float().abs().max()) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["w4a16", "w4a4", "quads"])
def test_projections_prepared_from_stacked_parameters_compute_on_cuda_what_they_compute_on_cpu(precision: str) -> None:
    """The vLLM plugin's CUDA branch (a GroupedProjection over its parameters, prepared once) gives
    the CPU reference's layer output within the kernels' summation order."""
    from megatron_quads.rollout.grouped_experts import GroupedExperts

    hidden, ffn = 128, 64
    outputs = {}
    for device in ("cpu", "cuda"):
        layer = GroupedExperts(_projection_from_parameters(precision, 2 * ffn, hidden, 32, device, seed=1),
                               _projection_from_parameters(precision, hidden, ffn, 16, device, seed=2))
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(40, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
        top_k_index = torch.rand(40, E, generator=gen).topk(2, dim=1).indices.to(device)
        top_k_weights = torch.rand(40, 2, generator=gen).to(device)
        outputs[device] = layer(x, top_k_index, top_k_weights, torch.nn.functional.silu).float().cpu()
    reference = outputs["cpu"]
    torch.testing.assert_close(outputs["cuda"], reference, rtol=2e-2, atol=2e-2 * float(reference.abs().max()))
    assert float(reference.abs().max()) > 0
