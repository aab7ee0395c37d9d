"""Widening a grouped W4A4 + RAC tail to the warp-specialized kernel's ring step
(``w4a4.padded_tail``, applied by ``w4a4.prepare_rac_tail`` when weights are prepared): the added
channels must be valid input channels (finite block values) and the added ``W_S`` columns exact
zeros, so the product is unchanged (checked end to end against the fp64 reference by the GPU test
``test_grouped_rac_down_projection_tails_run_widened_on_the_ws_kernel``, where the kernels run, and
here on the PyTorch reference, which takes a widened tail too); preparation widens where the
dispatch rule says and costs at most ``TAIL_PAD_MAX_GROWTH``, and leaves every other tail as it is."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_quads.kernels import dispatch
from megatron_quads.kernels.w4a4 import TAIL_PAD_MAX_GROWTH, padded_tail, prepare_rac_tail
from megatron_quads.nvfp4 import NVFP4Tensor, quantize
from megatron_quads.nvfp4.reblock import reblock_columns
from megatron_quads.rollout.grouped import expert_offsets_from_counts, expert_weight, grouped_rac_linear
from megatron_quads.rollout.rac import rac_linear

_GLUON_WS = dispatch.gluon_module("w4a16_ws")


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


def test_widened_tail_is_new_and_follows_the_weight_it_is_prepared_from() -> None:
    """The widened ``W_S`` is a copy made when preparing: a later in-place write (a weight sync)
    reaches it only when the tail is prepared again."""
    _, _, _, channels, residual = _case(seed=1)
    _, first = padded_tail(channels, residual, 32)
    assert first.codes.untyped_storage().data_ptr() != residual.codes.untyped_storage().data_ptr()
    before = first.codes.clone()
    residual.codes[0].fill_(0x11)  # a weight sync writes in place
    assert torch.equal(first.codes, before)
    _, synced = padded_tail(channels, residual, 32)
    assert torch.equal(synced.codes[..., :8], residual.codes) and not torch.equal(synced.codes, before)
    assert torch.equal(synced.scales.view(torch.uint8), first.scales.view(torch.uint8))  # the scale bytes did not change


def test_the_reference_takes_a_widened_tail_as_the_same_product() -> None:
    """Repeated channels over zero ``W_S`` columns add exact zeros: per expert the fp64-accumulated
    product is bit for bit the narrow tail's, and the grouped reference agrees within fp32 order."""
    x, weight, offsets, channels, residual = _case(seed=4)
    wide_channels, wide_residual = padded_tail(channels, residual, 64)
    for e in range(weight.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi == lo:
            continue
        narrow = rac_linear(x[lo:hi], expert_weight(weight, e), channels[e], expert_weight(residual, e),
                            accumulate_dtype=torch.float64)
        wide = rac_linear(x[lo:hi], expert_weight(weight, e), wide_channels[e], expert_weight(wide_residual, e),
                          accumulate_dtype=torch.float64)
        assert torch.equal(wide, narrow)
    narrow = grouped_rac_linear(x, weight, offsets, channels, residual)
    wide = grouped_rac_linear(x, weight, offsets, wide_channels, wide_residual)
    torch.testing.assert_close(wide, narrow, rtol=1e-6, atol=1e-6 * float(narrow.abs().max()))
    assert not torch.equal(narrow, grouped_rac_linear(x, weight, offsets))  # the tail is in use


def test_preparing_a_tail_off_the_ws_kernel_returns_it_as_given() -> None:
    """On a device where the warp-specialized kernel does not run (here: the CPU) preparation
    returns the very tensors it was given, with or without channels."""
    _, _, _, channels, residual = _case(seed=5)
    cpu = torch.device("cpu")
    prepared = prepare_rac_tail(channels, residual, 768, cpu)
    assert prepared[0] is channels and prepared[1] is residual
    empty = channels[:, :0]
    assert prepare_rac_tail(empty, residual, 768, cpu)[0] is empty


@pytest.mark.skipif(_GLUON_WS is None, reason="this Triton has no Gluon warp specialization")
def test_preparation_widens_where_the_ws_kernel_runs_and_growth_is_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the ws kernel taking calls on the device (faked), down-projection tails (K 768) of 96
    and 192 channels come out 256 wide, 384 as 512; 16 channels (growth 1.30 > TAIL_PAD_MAX_GROWTH)
    and a tail already whole steps come back as given, and preparing a prepared tail changes nothing."""
    monkeypatch.setattr(dispatch, "device_arch", lambda device: dispatch.SM90)
    cpu = torch.device("cpu")
    for s, width in ((16, 16), (96, 256), (192, 256), (256, 256), (384, 512)):
        _, _, _, channels, residual = _case(experts=2, n=16, k=768, s=s, seed=s)
        wide_channels, wide_residual = prepare_rac_tail(channels, residual, 768, cpu)
        assert wide_channels.shape == (2, width) and tuple(wide_residual.shape) == (2, 16, width)
        assert (width == s) == (wide_residual is residual)
        assert width == s or 768 + width <= TAIL_PAD_MAX_GROWTH * (768 + s)
        again = prepare_rac_tail(wide_channels, wide_residual, 768, cpu)
        assert again[0] is wide_channels and again[1] is wide_residual
    _, _, _, channels, residual = _case(experts=2, n=16, k=768 + 64, s=96)
    assert prepare_rac_tail(channels, residual, 768 + 64, cpu)[1] is residual  # K not a multiple of 128: no ws kernel


def test_widening_rejects_narrower_or_unaligned_widths() -> None:
    _, _, _, channels, residual = _case(seed=2)
    with pytest.raises(ValueError, match="larger multiple of 16"):
        padded_tail(channels, residual, 8)
    with pytest.raises(ValueError, match="larger multiple of 16"):
        padded_tail(channels, residual, 40)
    assert padded_tail(channels, residual, 16) == (channels, residual)


@pytest.mark.skipif(_GLUON_WS is None, reason="this Triton has no Gluon warp specialization")
def test_tail_width_rounds_up_to_the_ring_step_where_the_ws_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    ws = _GLUON_WS
    cpu = torch.device("cpu")
    assert dispatch.warp_specialized_tail_width(cpu, 768, 96) == 0  # not an sm_90 GPU
    monkeypatch.setattr(dispatch, "device_arch", lambda device: dispatch.SM90)
    assert ws.tail_step(768) == ws.tail_step(2048) == 256
    assert [dispatch.warp_specialized_tail_width(cpu, 768, s) for s in (0, 96, 192, 256, 384)] == [0, 256, 256, 256, 512]
    assert dispatch.warp_specialized_tail_width(cpu, 768 + 64, 96) == 0  # K not a multiple of 128: no ws kernel
