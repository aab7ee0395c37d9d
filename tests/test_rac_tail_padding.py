"""Widening a grouped W4A4 + RAC tail to the warp-specialized kernel's ring step
(``w4a4.padded_tail``): the added channels must be valid input channels (finite block values) and
the added ``W_S`` columns exact zeros, so the product is unchanged (checked end to end against the
fp64 reference by the GPU test ``test_grouped_rac_down_projection_tails_run_widened_on_the_ws_kernel``,
where the kernels run); the widened ``W_S`` is built once per weight (and again after an in-place
write). The widened channel set repeats a channel, which the PyTorch reference's channel checks
reject: only the kernel path widens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_quads.nvfp4 import NVFP4Tensor, quantize
from megatron_quads.kernels import dispatch
from megatron_quads.kernels.w4a4 import padded_tail
from megatron_quads.rollout.grouped import expert_offsets_from_counts, expert_weight
from megatron_quads.rollout.rac import reblock_columns


def _case(experts: int = 3, n: int = 24, k: int = 64, s: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, n, k, generator=g) * 0.05
    weight = quantize(w, global_amax=w.abs().amax(dim=(1, 2)).unsqueeze(1))
    channels = torch.stack([torch.randperm(k, generator=g)[:s].sort().values for _ in range(experts)]).to(torch.int32)
    parts = [reblock_columns(expert_weight(weight, e), channels[e]) for e in range(experts)]
    residual = NVFP4Tensor(codes=torch.stack([p.codes for p in parts]), scales=torch.stack([p.scales for p in parts]),
                           weight_scale_2=weight.weight_scale_2, shape=torch.Size((experts, n, s)), dtype=weight.dtype)
    counts = torch.tensor([5, 0, 9][:experts])
    x = torch.randn(int(counts.sum()), k, generator=g) * torch.linspace(0.1, 4.0, k)  # outlier channels
    return x, weight, expert_offsets_from_counts(counts), channels, residual


def test_widened_tail_adds_valid_channels_and_zero_weight_columns() -> None:
    _, _, _, channels, residual = _case()
    wide_channels, wide_residual = padded_tail(channels, residual, 48)
    assert wide_channels.shape == (3, 48) and tuple(wide_residual.shape) == (3, 24, 48)
    assert torch.equal(wide_channels[:, :16], channels)
    assert torch.equal(wide_channels[:, 16:], channels[:, -1:].expand(-1, 32))  # in range: finite values
    assert wide_residual.weight_scale_2 is residual.weight_scale_2
    dq = wide_residual.dequantize(torch.float32)
    assert torch.equal(dq[..., :16], residual.dequantize(torch.float32))
    assert not dq[..., 16:].any()  # zero codes and zero scales: every added product is +-0
    assert not wide_residual.codes[..., 8:].any() and not wide_residual.scales.view(torch.uint8)[..., 1:].any()


def test_widened_residual_weight_is_cached_until_written_in_place() -> None:
    _, _, _, channels, residual = _case(seed=1)
    _, first = padded_tail(channels, residual, 32)
    _, again = padded_tail(channels, residual, 32)
    assert again.codes is first.codes and again.scales is first.scales
    residual.codes[0].fill_(0x11)  # a weight sync writes in place
    _, synced = padded_tail(channels, residual, 32)
    assert synced.codes is not first.codes and torch.equal(synced.codes[..., :8], residual.codes)
    assert synced.scales is first.scales  # the scale bytes did not change


def test_widening_rejects_narrower_or_unaligned_widths() -> None:
    _, _, _, channels, residual = _case(seed=2)
    with pytest.raises(ValueError, match="larger multiple of 16"):
        padded_tail(channels, residual, 8)
    with pytest.raises(ValueError, match="larger multiple of 16"):
        padded_tail(channels, residual, 40)
    assert padded_tail(channels, residual, 16) == (channels, residual)


@pytest.mark.skipif(dispatch.gluon_module("w4a16_ws") is None, reason="this Triton has no Gluon warp specialization")
def test_tail_width_rounds_up_to_the_ring_step_where_the_ws_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    ws = dispatch.gluon_module("w4a16_ws")
    cpu = torch.device("cpu")
    assert dispatch.warp_specialized_tail_width(cpu, 768, 96) == 0  # not an sm_90 GPU
    monkeypatch.setattr(dispatch, "device_arch", lambda device: dispatch.SM90)
    assert ws.tail_step(768) == ws.tail_step(2048) == 256
    assert [dispatch.warp_specialized_tail_width(cpu, 768, s) for s in (0, 96, 192, 256, 384)] == [0, 256, 256, 256, 512]
    assert dispatch.warp_specialized_tail_width(cpu, 768 + 64, 96) == 0  # K not a multiple of 128: no ws kernel
