"""``W_S`` re-blocking and global-amax recovery (``nvfp4.reblock``, ``nvfp4.global_scale``) on CPU."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.nvfp4 import NVFP4Tensor, decode_scale_from_amax, dequantize, quantize
from megatron_quads.nvfp4.global_scale import global_amax_from_decode_scale
from megatron_quads.nvfp4.reblock import check_channel_rows, reblock_columns, reblock_columns_deferred
from megatron_quads.nvfp4.stacked import expert_weight, stack_experts

N, K = 24, 128


def _weight(seed: int, scale: float = 1.0) -> NVFP4Tensor:
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(N, K, generator=gen) * scale)


def _unaligned_channels(seed: int, count: int = 48) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(K, generator=gen)[:count].sort().values.to(torch.int32)


def test_recovered_amax_reproduces_every_decode_scale() -> None:
    amax = torch.logspace(-30, 30, 4001, dtype=torch.float32)
    ws2 = decode_scale_from_amax(amax)
    recovered, missing = global_amax_from_decode_scale(ws2)
    assert not missing.any()
    assert torch.equal(decode_scale_from_amax(recovered), ws2)


def test_decode_scales_without_an_amax_are_flagged() -> None:
    ws2 = decode_scale_from_amax(torch.linspace(1.0, 2.0, 2001))
    neighbours = torch.nextafter(ws2, torch.full_like(ws2, float("inf")))
    _, missing = global_amax_from_decode_scale(neighbours)
    assert missing.any(), "some fp32 values are amax / 2688 for no fp32 amax"
    _, special = global_amax_from_decode_scale(torch.tensor([float("nan"), -1.0, float("inf")]))
    assert special.tolist() == [True, True, True]
    damaged = neighbours[missing][0]
    weight = _weight(0)
    broken = NVFP4Tensor(weight.codes, weight.scales, damaged.reshape(()), weight.shape, weight.dtype)
    with pytest.raises(ValueError, match="not amax / 2688 for any fp32 amax"):
        reblock_columns(broken, _unaligned_channels(1))
    _, flag = reblock_columns_deferred(broken, _unaligned_channels(1))
    assert bool(flag)


def test_unaligned_blocks_are_the_gathered_dequantized_columns_quantized_with_the_weights_amax() -> None:
    weight = _weight(2)
    channels = _unaligned_channels(3)
    amax, _ = global_amax_from_decode_scale(weight.weight_scale_2)
    expected = quantize(dequantize(weight, torch.float32).index_select(-1, channels.long()), global_amax=amax)
    residual = reblock_columns(weight, channels)
    assert torch.equal(residual.weight_scale_2, weight.weight_scale_2)
    assert torch.equal(residual.codes, expected.codes)
    assert torch.equal(residual.scales.view(torch.uint8), expected.scales.view(torch.uint8))


def test_whole_blocks_are_copied_and_every_channel_gives_the_weight_back() -> None:
    weight = _weight(4)
    whole = reblock_columns(weight, torch.arange(K, dtype=torch.int32))
    assert torch.equal(whole.codes, weight.codes)
    assert torch.equal(whole.scales.view(torch.uint8), weight.scales.view(torch.uint8))
    block = reblock_columns(weight, torch.arange(32, 48, dtype=torch.int32))
    assert torch.equal(block.codes, weight.codes[:, 16:24])
    assert torch.equal(block.scales.view(torch.uint8), weight.scales.view(torch.uint8)[:, 2:3])


def test_a_stack_is_re_blocked_as_each_of_its_experts() -> None:
    experts = [_weight(5 + e, scale=10.0 ** (e - 1)) for e in range(3)]
    stacked = stack_experts(experts)
    channels = torch.stack([_unaligned_channels(10 + e) for e in range(3)])
    residual, no_amax = reblock_columns_deferred(stacked, channels)
    assert residual.codes.shape == (3, N, 24) and not no_amax.any()
    for e in range(3):
        single = reblock_columns(expert_weight(stacked, e), channels[e])
        assert torch.equal(residual.codes[e], single.codes)
        assert torch.equal(residual.scales[e].view(torch.uint8), single.scales.view(torch.uint8))


def test_empty_and_invalid_channel_sets() -> None:
    weight = _weight(6)
    empty = reblock_columns(weight, torch.zeros(0, dtype=torch.int32))
    assert empty.codes.shape == (N, 0) and empty.scales.shape == (N, 0)
    with pytest.raises(ValueError, match="not sorted ascending"):
        reblock_columns(weight, _unaligned_channels(7).flip(0))
    with pytest.raises(ValueError, match="multiple of 16"):
        reblock_columns(weight, torch.arange(8, dtype=torch.int32))


def test_channel_sets_are_checked_row_by_row_with_the_failing_row_named() -> None:
    """check_channel_rows accepts what check_channels accepts in every row and raises check_channels'
    error for the first row that fails, named by ``where``."""
    good = torch.stack([_unaligned_channels(20 + e) for e in range(4)])
    check_channel_rows(good, K, lambda row: f"expert {row}")
    check_channel_rows(good[:, :0], K, lambda row: f"expert {row}")  # no channels: nothing to read
    cases = {"not sorted ascending": lambda t: t[2].copy_(t[2].flip(0)),
             "repeats channel": lambda t: t[2, 1].copy_(t[2, 0]),
             "outside": lambda t: t[2, -1].fill_(K)}
    for message, damage in cases.items():
        bad = good.clone()
        damage(bad)
        bad[3].copy_(bad[2])  # a later bad row: the first is named
        with pytest.raises(ValueError, match=f"expert 2.*{message}"):
            check_channel_rows(bad, K, lambda row: f"expert {row}")
    with pytest.raises(ValueError, match="expert 0 holds 8 channels; the count must be a multiple of 16"):
        check_channel_rows(good[:, :8], K, lambda row: f"expert {row}")
    with pytest.raises(ValueError, match="integer tensor"):
        check_channel_rows(good.float(), K, lambda row: f"expert {row}")
