"""The ``grouped_gemm`` stand-in of Megatron's legacy GroupedMLP: ``torch._grouped_mm`` over row groups
padded to 8 rows on CUDA, one matmul per expert elsewhere; both give the per-expert products."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.trainer.megatron_fixes import (
    GROUP_ROW_ALIGN,
    _TorchGroupedGemmOps,
    grouped_mm,
    grouped_mm_fits,
    padded_group_rows,
)

COUNTS = [5, 0, 16, 3, 8, 11]  # empty, aligned and unaligned groups: the padded path
ALIGNED = [8, 0, 16, 24, 8, 8]  # every group on an 8-row boundary: the path without padding


def _per_expert(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.cat([rows @ b[e] for e, rows in enumerate(torch.split(a, counts))])


def _operands(device: str, dtype: torch.dtype, k: int = 32, n: int = 48,
              counts: list[int] = COUNTS) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(sum(counts), k, generator=generator).to(device, dtype)
    b = torch.randn(len(counts), k, n, generator=generator).to(device, dtype)
    return a, b


def test_padded_group_rows_start_every_group_on_an_aligned_row() -> None:
    dest, ends = padded_group_rows(COUNTS)
    assert ends == [8, 8, 24, 32, 40, 56]
    starts = [0, *ends[:-1]]
    expected = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, COUNTS)])
    assert torch.equal(dest, expected)
    assert all(end % GROUP_ROW_ALIGN == 0 for end in ends)


@pytest.mark.parametrize("counts", [COUNTS, ALIGNED])
def test_grouped_mm_gives_each_groups_product(counts: list[int]) -> None:
    """CPU: torch's grouped GEMM forward (its CPU backward is not used here; CUDA below)."""
    a, b = _operands("cpu", torch.float32, counts=counts)
    torch.testing.assert_close(grouped_mm(a, b, counts), _per_expert(a, b, counts), rtol=1e-5, atol=1e-5)


def test_the_stand_in_loops_over_experts_off_cuda_with_gradients() -> None:
    a, b = _operands("cpu", torch.bfloat16)
    assert not grouped_mm_fits(a, b)
    a.requires_grad_(True)
    bt = b.transpose(1, 2).contiguous().requires_grad_(True)
    out = _TorchGroupedGemmOps.gmm(a, bt, torch.tensor(COUNTS), trans_b=True)
    assert torch.equal(out, _per_expert(a.detach(), b, COUNTS))
    out.float().sum().backward()
    assert a.grad is not None and bt.grad is not None and bt.grad[1].abs().sum() == 0  # expert 1 got no rows


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [COUNTS, ALIGNED])
@pytest.mark.parametrize("trans_b", [False, True])
def test_cuda_grouped_mm_gives_the_per_expert_products_and_gradients(trans_b: bool, counts: list[int]) -> None:
    """bf16 on CUDA: outputs and both gradients against an fp32 per-expert reference, within bf16
    rounding of the inputs' products (relative error of each tensor's norm under 1e-2)."""
    a, b = _operands("cuda", torch.bfloat16, k=64, n=128, counts=counts)
    weights = (b.transpose(1, 2).contiguous() if trans_b else b).requires_grad_(True)
    a.requires_grad_(True)
    assert grouped_mm_fits(a, b)
    out = _TorchGroupedGemmOps.gmm(a, weights, torch.tensor(counts), trans_b=trans_b)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    a32 = a.detach().float().requires_grad_(True)
    w32 = weights.detach().float().requires_grad_(True)
    ref = _per_expert(a32, w32.transpose(1, 2) if trans_b else w32, counts)
    ref.backward(grad_out.float())
    for got, want in ((out, ref), (a.grad, a32.grad), (weights.grad, w32.grad)):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert (got.float() - want).norm() <= 1e-2 * want.norm()
    assert weights.grad[1].abs().sum() == 0  # expert 1 got no rows
