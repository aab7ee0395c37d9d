"""The MoE routing kernels against their definitions, ``route_by_expert`` and ``combine_routed_rows``
on the CPU.

GPU tests (``-m gpu``): on the GPU machine, or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_quads.kernels.moe_routing import (
    combine_routed_rows_kernel,
    route_by_expert_kernel,
)
from megatron_quads.rollout.grouped import combine_routed_rows, route_by_expert


def _routing(tokens: int, experts: int, top_k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, slot_rows)`` of a random top-k routing: rows sorted by expert (stable), and back."""
    index = torch.rand(tokens, experts).topk(top_k, dim=1).indices.to(device)
    order = torch.argsort(index.reshape(-1), stable=True)
    slot_rows = torch.empty_like(order)
    slot_rows[order] = torch.arange(order.numel(), device=device)
    return order, slot_rows.view(tokens, top_k)


def _cpu_reference(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return combine_routed_rows(y.cpu(), order.cpu(), weights.cpu(), out_dtype)  # CPU: index_add_, rows in order


@pytest.mark.gpu
@pytest.mark.parametrize(("y_dtype", "w_dtype", "out_dtype"), [
    (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.float32, torch.float16),
])
@pytest.mark.parametrize(("tokens", "top_k", "hidden"), [(5, 1, 48), (9, 6, 200), (33, 8, 1040)])
def test_combine_is_the_cpu_index_add_bit_for_bit(kernel_device: str, y_dtype: torch.dtype, w_dtype: torch.dtype,
                                                  out_dtype: torch.dtype, tokens: int, top_k: int, hidden: int) -> None:
    """Products rounded to the promoted dtype then the output's, summed in fp32 in row order and
    rounded once: the reference's bits, on values spread over many binades (so that the add order
    and every rounding show) and with signed zeros."""
    torch.manual_seed(tokens * 100 + top_k)
    order, slot_rows = _routing(tokens, 16, top_k, kernel_device)
    y = (torch.randn(tokens * top_k, hidden) * torch.exp2(torch.randint(-12, 12, (tokens * top_k, hidden)).float()))
    y[0, :3] = torch.tensor([0.0, -0.0, -0.0])
    y = y.to(y_dtype).to(kernel_device)
    weights = torch.rand(tokens, top_k).to(w_dtype).to(kernel_device)
    out = torch.full((tokens, hidden), float("nan"), dtype=out_dtype, device=kernel_device)
    assert combine_routed_rows_kernel(y, slot_rows, weights, out) is out
    expected = _cpu_reference(y, order, weights, out_dtype)
    assert torch.equal(out.cpu().view(torch.uint8) if out_dtype != torch.float32 else out.cpu().view(torch.int32),
                       expected.view(torch.uint8) if out_dtype != torch.float32 else expected.view(torch.int32))


@pytest.mark.gpu
def test_combine_argument_errors(kernel_device: str) -> None:
    _, slot_rows = _routing(4, 8, 2, kernel_device)
    y = torch.zeros(8, 16, dtype=torch.bfloat16, device=kernel_device)
    weights = torch.ones(4, 2, device=kernel_device)
    with pytest.raises(ValueError, match=r"slot_rows int64 \[T, top_k\]"):
        combine_routed_rows_kernel(y, slot_rows, weights[:, :1], torch.empty(4, 16, dtype=torch.bfloat16, device=kernel_device))
    with pytest.raises(TypeError, match="y must be bfloat16, float16 or float32"):
        combine_routed_rows_kernel(y.double(), slot_rows, weights, torch.empty(4, 16, dtype=torch.bfloat16, device=kernel_device))


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "experts"), [(1, 1), (7, 1), (64, 16), (4096, 128), (5003, 40)])
def test_routing_is_the_stable_argsort(kernel_device: str, rows: int, experts: int) -> None:
    """Order: a stable sort of the ids (ties keep their input order), offsets: where each expert's
    rows start, empty experts included (a few experts get most rows here); several id blocks at 5003."""
    torch.manual_seed(rows + experts)
    ids = torch.distributions.Categorical(logits=torch.randn(experts) * 2).sample((rows,)).to(kernel_device)
    order = torch.full((rows,), -1, dtype=torch.int64, device=kernel_device)
    offsets = torch.full((experts + 1,), -1, dtype=torch.int32, device=kernel_device)
    written = route_by_expert_kernel(ids, experts, order, offsets)
    assert written[0] is order and written[1] is offsets
    expected_order, expected_offsets = route_by_expert(ids.cpu(), experts)
    assert torch.equal(order.cpu(), expected_order) and torch.equal(offsets.cpu(), expected_offsets)
    fresh_order, fresh_offsets = route_by_expert_kernel(ids, experts)
    assert torch.equal(fresh_order, order) and torch.equal(fresh_offsets, offsets)


@pytest.mark.gpu
def test_routing_argument_errors(kernel_device: str) -> None:
    with pytest.raises(ValueError, match="1-D int64"):
        route_by_expert_kernel(torch.zeros(4, dtype=torch.int32, device=kernel_device), 2)
    with pytest.raises(ValueError, match="num_experts must be positive"):
        route_by_expert_kernel(torch.zeros(4, dtype=torch.int64, device=kernel_device), 0)
    ids = torch.zeros(4, dtype=torch.int64, device=kernel_device)
    with pytest.raises(ValueError, match=r"order must be a contiguous int64 tensor of shape \(4,\)"):
        route_by_expert_kernel(ids, 2, order=torch.empty(4, dtype=torch.int32, device=kernel_device))
    with pytest.raises(ValueError, match=r"offsets must be a contiguous int32 tensor of shape \[3\]"):
        route_by_expert_kernel(ids, 2, offsets=torch.empty(2, dtype=torch.int32, device=kernel_device))
