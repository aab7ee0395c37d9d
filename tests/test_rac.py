"""Residual Activation Compensation and the W4A4 reference GEMM."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.nvfp4 import quantize
from megatron_quads.nvfp4.reblock import reblock_columns
from megatron_quads.rollout.calibration import (
    ChannelStats,
    RacCalibrator,
    StackChannelStats,
    pool_stats,
    select_from_stats,
    select_stack_channels,
)
from megatron_quads.rollout.rac import (
    ChannelStatistic,
    num_residual_channels,
    rac_linear,
    rac_operands,
    select_channels,
    validate_channels,
)
from megatron_quads.rollout.w4a4 import (
    ActivationScale,
    activation_amax,
    nvfp4_gemm,
    w4a4_linear,
)

K, N, T = 256, 96, 64


def _outlier_inputs(seed: int = 0, tokens: int = T) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, K, generator=gen)
    hot = torch.randperm(K, generator=gen)[:12]
    x[:, hot] *= 30.0  # outlier channels, as in LLM activations
    return x.to(torch.bfloat16)


def _weight(seed: int = 1) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05


def _quantized_weight(seed: int = 1):
    return quantize(_weight(seed).to(torch.bfloat16))


def test_w4a4_linear_is_the_product_of_dequantized_operands() -> None:
    x, wq = _outlier_inputs(), _quantized_weight()
    y = w4a4_linear(x, wq, accumulate_dtype=torch.float64)
    xq = quantize(x, global_amax=x.abs().amax(-1).float())
    expected = (xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).t()).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (T, N)
    assert (y.float() - expected.float()).abs().max() <= 2 ** -7 * expected.float().abs().max()


def test_augmented_gemm_equals_the_sum_of_two_gemms_exactly() -> None:
    x, wq = _outlier_inputs(), _quantized_weight()
    channels = select_channels(torch.rand(K, generator=torch.Generator().manual_seed(3)), 0.25)
    ws = reblock_columns(wq, channels)
    a, a_decode, w = rac_operands(x.float(), wq, channels, ws)
    assert a.shape == (T, K + 64) and w.shape == (N, K + 64)
    # products of FP4 operands and their sums are exact in float64: the accumulators agree bit for bit
    one = a.double() @ w.double().t()
    two = a[:, :K].double() @ w[:, :K].double().t() + a[:, K:].double() @ w[:, K:].double().t()
    assert torch.equal(one, two)
    y = nvfp4_gemm(a, a_decode, w, wq.weight_scale_2, torch.float32, torch.float64)
    alpha = a_decode.unsqueeze(-1) * wq.weight_scale_2
    assert torch.equal(y, two.to(torch.float32) * alpha)
    # fp32 accumulation differs from that only by summation order
    fp32 = nvfp4_gemm(a, a_decode, w, wq.weight_scale_2, torch.float32, torch.float32)
    assert torch.allclose(fp32, y, rtol=1e-5, atol=1e-5 * y.abs().max().item())


def test_rac_error_falls_with_the_ratio_and_at_100_percent_is_the_second_pass_error() -> None:
    x, wq = _outlier_inputs(), _quantized_weight()
    reference = x.double() @ wq.dequantize(torch.float64).t()  # trainer side: AQAT weights, exact activations
    stats = ChannelStats(K)
    stats.update(x)
    scores = stats.scores(ChannelStatistic.OUTPUT_ERROR, wq)
    errors = []
    for ratio in (0.0, 0.125, 0.25, 0.5, 1.0):
        channels = select_channels(scores, ratio)
        y = rac_linear(x.float(), wq, channels, reblock_columns(wq, channels), accumulate_dtype=torch.float64)
        errors.append(float((y.double() - reference).norm() / reference.norm()))
    assert all(later < earlier for earlier, later in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < errors[0] / 4
    # at 100% the only activation error left is the residual's own quantization error
    amax = activation_amax(x.float(), ActivationScale.PER_TOKEN)
    xq = quantize(x.float(), global_amax=amax).dequantize(torch.float64)
    r = x.double() - xq
    rq = quantize(r.float(), global_amax=amax).dequantize(torch.float64)
    second_pass_only = ((x.double() - xq - rq) @ wq.dequantize(torch.float64).t()).norm() / reference.norm()
    assert errors[-1] == pytest.approx(float(second_pass_only), rel=1e-4)


def test_residual_weight_is_exact_when_all_channels_are_taken() -> None:
    wq = _quantized_weight()
    ws = reblock_columns(wq, torch.arange(K, dtype=torch.int32))
    assert torch.equal(ws.codes, wq.codes) and torch.equal(ws.scales.view(torch.uint8), wq.scales.view(torch.uint8))
    assert torch.equal(ws.weight_scale_2, wq.weight_scale_2)
    partial = reblock_columns(wq, select_channels(torch.arange(K, dtype=torch.float32), 0.125))
    assert partial.codes.shape == (N, 16) and torch.equal(partial.weight_scale_2, wq.weight_scale_2)


def test_reblock_depends_only_on_the_stored_fields() -> None:
    wq = _quantized_weight()
    from dataclasses import replace

    stored = replace(wq, global_amax=None)
    channels = torch.arange(0, K, 2, dtype=torch.int32)[:64]
    a, b = reblock_columns(wq, channels), reblock_columns(stored, channels)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.weight_scale_2, b.weight_scale_2)


@pytest.mark.parametrize(("k", "ratio", "expected"), [(256, 0.125, 32), (256, 0.0, 0), (256, 1.0, 256), (64, 0.1, 0), (64, 0.2, 16), (2048, 0.5, 1024)])
def test_ratio_rounds_to_whole_blocks(k: int, ratio: float, expected: int) -> None:
    assert num_residual_channels(k, ratio) == expected


def test_select_channels_takes_the_top_scores_sorted() -> None:
    scores = torch.zeros(64)
    scores[[50, 3, 40, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31]] = torch.arange(16, 0, -1).float()
    channels = select_channels(scores, 0.25)
    assert channels.dtype == torch.int32
    assert channels.tolist() == sorted([50, 3, 40, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31])
    assert select_channels(torch.ones(64), 0.25).tolist() == list(range(16))  # ties: lower index first


@pytest.mark.parametrize(
    ("channels", "pattern"),
    [
        (torch.arange(15, dtype=torch.int32), "multiple of 16"),
        (torch.arange(16, 32, dtype=torch.int32).flip(0), "ascending"),
        (torch.arange(250, 266, dtype=torch.int32), r"outside \[0, K=256\)"),
        (torch.arange(16, dtype=torch.float32), "integer tensor"),
    ],
)
def test_invalid_channel_sets_are_rejected(channels: torch.Tensor, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        validate_channels(channels, K)


def test_static_activation_scale_needs_an_amax() -> None:
    with pytest.raises(ValueError, match="static_amax"):
        w4a4_linear(_outlier_inputs(), _quantized_weight(), mode=ActivationScale.STATIC)
    x = _outlier_inputs()
    static = w4a4_linear(x, _quantized_weight(), mode=ActivationScale.STATIC, static_amax=float(x.abs().max()))
    per_tensor = w4a4_linear(x, _quantized_weight(), mode=ActivationScale.PER_TENSOR)
    assert torch.equal(static, per_tensor)


def test_per_token_scales_beat_per_tensor_scales_with_outlier_tokens() -> None:
    x = _outlier_inputs().float()
    x[0] *= 1000.0  # one huge token squeezes everyone else's block scales under a per-tensor scale
    wq = _quantized_weight()
    ref = x.double() @ wq.dequantize(torch.float64).t()
    err = {
        mode: float((w4a4_linear(x, wq, mode=mode, accumulate_dtype=torch.float64).double() - ref)[1:].norm())
        for mode in (ActivationScale.PER_TOKEN, ActivationScale.PER_TENSOR)
    }
    assert err[ActivationScale.PER_TOKEN] < err[ActivationScale.PER_TENSOR]


def test_calibration_hooks_rank_channels_by_residual_and_weight() -> None:
    layer = torch.nn.Linear(K, N, bias=False)
    with torch.no_grad():
        layer.weight.copy_(_weight())
        layer.weight[:, :16] = 0.0  # block 0's error cannot reach the output
    calibrator = RacCalibrator({"proj": layer}, {"proj": K})
    x = torch.randn(128, K)
    # an outlier sets its block's scale and crushes the other 15 channels of the block to zero: the
    # residual sits in the neighbours, not in the outlier itself
    x[:, [5, 77]] *= 40.0
    layer(x)
    layer(x[:16])
    calibrator.detach()
    layer(x)  # no longer recorded
    assert calibrator.stats["proj"].tokens == 144
    neighbours_5, neighbours_77 = set(range(16)) - {5}, set(range(64, 80)) - {77}
    by_residual = set(calibrator.select(0.125, ChannelStatistic.RESIDUAL_ENERGY)["proj"].tolist())
    by_output = set(calibrator.select(0.125, ChannelStatistic.OUTPUT_ERROR, {"proj": layer.weight})["proj"].tolist())
    by_magnitude = set(calibrator.select(1 / 16, ChannelStatistic.ACTIVATION_MAGNITUDE)["proj"].tolist())
    assert neighbours_5 | neighbours_77 <= by_residual
    assert neighbours_77 <= by_output and not by_output & set(range(16))
    assert {5, 77} <= by_magnitude
    with pytest.raises(ValueError, match="needs the layer's weight"):
        calibrator.select(0.25, ChannelStatistic.OUTPUT_ERROR)


def test_online_statistics_follow_the_stream() -> None:
    stats = ChannelStats(64, momentum=0.5)
    early, late = torch.randn(32, 64), torch.randn(32, 64)
    early[:, 3] *= 50
    late[:, 60] *= 50
    stats.update(early)
    assert select_channels(stats.scores(ChannelStatistic.ACTIVATION_MAGNITUDE), 0.25).tolist().count(3) == 1
    for _ in range(6):
        stats.update(late)
    top = int(stats.scores(ChannelStatistic.ACTIVATION_MAGNITUDE).argmax())
    assert top == 60
    with pytest.raises(ValueError, match="momentum"):
        ChannelStats(8, momentum=0.0)


def test_amax_is_the_largest_input_ever_seen_and_pooling_keeps_it() -> None:
    a, b = ChannelStats(32, momentum=0.5), ChannelStats(32)
    a.update(torch.full((4, 32), -3.0))
    a.update(torch.ones(8, 32))  # momentum averages the means, not the amax
    x = torch.randn(12, 32)
    b.update(x)
    assert a.amax == 3.0 and b.amax == float(x.abs().max())
    pooled = pool_stats([a, b, ChannelStats(32)])  # a module that saw nothing adds nothing
    assert pooled.tokens == 24 and pooled.amax == max(a.amax, b.amax)
    assert torch.allclose(pooled.residual_sq, (12 * a.residual_sq + 12 * b.residual_sq) / 24)
    with pytest.raises(ValueError, match="cannot pool statistics of 32 and 16 input features"):
        pool_stats([a, ChannelStats(16)])


def test_an_expert_without_tokens_gets_an_empty_output() -> None:
    wq = _quantized_weight()
    empty = torch.zeros(0, K, dtype=torch.bfloat16)
    channels = torch.arange(16, dtype=torch.int32)
    assert w4a4_linear(empty, wq).shape == (0, N)
    assert w4a4_linear(empty, wq, mode=ActivationScale.PER_TENSOR).shape == (0, N)
    assert rac_linear(empty, wq, channels, reblock_columns(wq, channels)).shape == (0, N)


def test_unseen_modules_take_the_channels_of_their_pool() -> None:
    """Experts nothing was routed to get channels from their group's token-weighted statistics."""
    torch.manual_seed(0)
    k = 64
    layers = {name: torch.nn.Linear(k, 8, bias=False) for name in ("e0", "e1", "e2", "other")}
    calibrator = RacCalibrator(layers, {name: k for name in layers})
    x0 = torch.randn(5, k)
    x0[:, 3] *= 40  # e0's inputs: channel 3 dominates
    x1 = torch.randn(15, k)
    x1[:, 7] *= 60  # e1's (three times as many tokens): channel 7 dominates
    layers["e0"](x0)
    layers["e1"](x1)
    calibrator.detach()
    pools = {"e0": "layer", "e1": "layer", "e2": "layer"}
    plain = calibrator.select(0.25, ChannelStatistic.RESIDUAL_ENERGY)
    assert set(plain) == {"e0", "e1"}
    chosen = calibrator.select(0.25, ChannelStatistic.RESIDUAL_ENERGY, pools=pools)
    assert set(chosen) == {"e0", "e1", "e2"} and torch.equal(chosen["e0"], plain["e0"])
    pooled = (5 * calibrator.stats["e0"].residual_sq + 15 * calibrator.stats["e1"].residual_sq) / 20
    assert torch.equal(chosen["e2"], select_channels(pooled, 0.25))
    assert {3, 7} <= set(chosen["e2"].tolist())
    narrow = torch.nn.Linear(32, 8, bias=False)
    bad = RacCalibrator({"a": layers["e0"], "b": narrow}, {"a": k, "b": 32})
    layers["e0"](x0)
    narrow(torch.randn(2, 32))
    bad.detach()
    with pytest.raises(ValueError, match="mixes modules"):
        bad.select(0.25, ChannelStatistic.RESIDUAL_ENERGY, pools={"a": "p", "b": "p"})


@pytest.mark.parametrize("statistic", list(ChannelStatistic))
def test_a_stacks_channels_chosen_at_once_are_each_experts_own_choice(statistic: ChannelStatistic,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """select_stack_channels (all experts of a projection at once, the vLLM plugin's calibration) picks, row
    by row, what select_from_stats picks expert by expert with the experts pooled: also for an expert that
    saw no input, for tied scores (a dead input channel) and when the weight is scored in chunks."""
    from megatron_quads.nvfp4.stacked import expert_weight, quantize_experts
    from megatron_quads.rollout import calibration

    torch.manual_seed(0)
    experts, n, k = 5, 24, 64
    weights = torch.randn(experts, n, k)
    stack = quantize_experts(weights, weights.abs().amax(dim=(1, 2)))
    stats = [ChannelStats(k) for _ in range(experts)]
    for e, s in enumerate(stats):
        if e == 2:
            continue  # nothing routed to expert 2
        x = torch.randn(3 + 4 * e, k)
        x[:, 5] = 0.0  # a dead channel: equal scores
        x[:, 7 * e % k] *= 30
        s.update(x)
    names = {f"{e}": s for e, s in enumerate(stats)}
    one_by_one = select_from_stats(names, 0.25, statistic, {f"{e}": expert_weight(stack, e) for e in range(experts)},
                                   dict.fromkeys(names, "w13"))
    monkeypatch.setattr(calibration, "STACK_SCORE_BYTES", 2 * 8 * n * k)  # two experts a chunk
    at_once = select_stack_channels(stats, stack, 0.25, statistic)
    assert at_once.shape == (experts, 16) and at_once.dtype == torch.int32
    for e in range(experts):
        assert torch.equal(at_once[e], one_by_one[f"{e}"]), e
    assert select_stack_channels([ChannelStats(k) for _ in range(experts)], stack, 0.25, statistic) is None



@pytest.mark.parametrize("chunk_rows", [None, 2])
def test_a_stacks_statistics_recorded_at_once_are_each_experts_own(chunk_rows: int | None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """StackChannelStats (the vLLM plugin's calibration) holds, per expert, what ChannelStats.update over
    that expert's rows of each batch holds: over several batches, with an expert no row reached and rows
    of an expert id one past the last (another rank's experts), which are not recorded; also when a
    batch's rows are taken in chunks."""
    from megatron_quads.rollout import calibration

    if chunk_rows is not None:
        monkeypatch.setattr(calibration, "STACK_UPDATE_ELEMENTS", chunk_rows * 32)
    torch.manual_seed(0)
    experts, k = 4, 32
    stacked = StackChannelStats(experts, k)
    one_by_one = [ChannelStats(k) for _ in range(experts)]
    for batch in range(3):
        ids = torch.tensor([0, 3, 0, 4, 1, 3, 3, 4, 0][: 5 + 2 * batch])  # expert 2 never, 4 = not recorded
        rows = torch.randn(ids.numel(), k, dtype=torch.bfloat16) * (1 + torch.arange(k))
        stacked.update(rows, ids)
        for e in range(experts):
            if (ids == e).any():
                one_by_one[e].update(rows[ids == e])
    recorded = stacked.per_expert()
    assert stacked.token_counts() == [s.tokens for s in one_by_one] == [7, 3, 0, 7]
    for mine, theirs in zip(recorded, one_by_one, strict=True):
        torch.testing.assert_close(mine.residual_sq, theirs.residual_sq, rtol=1e-12, atol=0)
        torch.testing.assert_close(mine.abs_activation, theirs.abs_activation, rtol=1e-12, atol=0)
        assert mine.amax == theirs.amax
    assert not recorded[2].residual_sq.any()
    with pytest.raises(ValueError, match=r"expected rows \[R, 32\]"):
        stacked.update(torch.zeros(3, 16), torch.zeros(3, dtype=torch.int64))
