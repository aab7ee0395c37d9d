"""Triton W4A4 + RAC kernels (megatron_quads.kernels.w4a4) against the PyTorch reference.

The prologue must be byte-identical to ``nvfp4.quantize`` (x part) and to the reference residual
quantization of :func:`megatron_quads.rollout.rac.rac_operands` (S part); the GEMMs must match an
fp64 product of the reference operands within fp32 accumulation error plus the output cast.
Run on CPU with ``TRITON_INTERPRET=1 pytest -q tests/test_kernels_w4a4.py`` (small shapes there).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_quads.kernels.w4a16 import X_ORDER_BLOCK_K, mma_k_order_rows
from megatron_quads.kernels.w4a4 import (
    GemmConfig,
    gemm_config,
    activation_block_values_kernel,
    grouped_rac_kernel,
    prepare_rac_tail,
    quantize_activations_kernel,
    rac_linear_kernel,
)
from megatron_quads.nvfp4 import NVFP4Tensor, quantize
from megatron_quads.nvfp4.reblock import reblock_columns
from megatron_quads.rollout.grouped import (
    expert_offsets_from_counts,
    expert_weight,
    grouped_rac_linear,
)
from megatron_quads.rollout.rac import rac_operands, select_channels
from megatron_quads.rollout.w4a4 import ActivationScale, activation_amax, block_values

# div_rn(1, 0) = inf (then clamped, as in the reference) makes numpy warn under the interpreter
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MODES = tuple(ActivationScale)


@pytest.fixture(autouse=True)
def _one_w4a16_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The RAC path runs on the autotuned W4A16 kernels; here they keep one tile config each (an
    autotuner with one config compiles it and does not time it), so every new shape costs one
    compile instead of a sweep. test_kernels_w4a16.py covers the tile configs themselves."""
    from megatron_quads.kernels import w4a16

    split_4 = [c for c in w4a16._dense_tuned.configs if c.kwargs["SPLIT_K"] == 4]  # the tail's split-K share too
    monkeypatch.setattr(w4a16._dense_tuned, "configs", split_4[:1] or w4a16._dense_tuned.configs[:1])
    for tuner in (w4a16._dense_tuned_large,):
        monkeypatch.setattr(tuner, "configs", tuner.configs[:1])
    for tuner in (w4a16._dense_tuned, w4a16._dense_tuned_large):
        # choices cached by other tests may be configs outside the list above, which the launcher
        # sizes its split-K buffers from
        monkeypatch.setattr(tuner, "cache", {})


_UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
_SMALLEST = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _activations(tokens: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random activations with outlier channels and per-token magnitudes spanning 1e-2..1e2."""
    g = _gen(seed)
    x = torch.randn(tokens, k, generator=g)
    x[:, torch.randperm(k, generator=g)[: max(1, k // 32)]] *= 25.0
    x *= 10.0 ** (4 * torch.rand(tokens, 1, generator=g) - 2)
    return x.to(dtype)


def _adversarial(k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows that stress the quantizer: zeros, a huge outlier, -0.0, tiny values, exact E2M1 ties."""
    g = _gen(seed)
    tiny = 1e-30 if dtype != torch.float16 else 1e-6
    zero = torch.zeros(k)
    outlier = torch.randn(k, generator=g) * 10.0 ** (-3 * torch.rand(k, generator=g))  # some subnormal e4m3 scales
    outlier[int(torch.randint(k, (1,), generator=g))] = 3.0e4
    neg_zero = torch.randn(k, generator=g)
    neg_zero[::3] = -0.0
    small = torch.randn(k, generator=g) * tiny
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.1])
    ties = ties.repeat(k // 16)
    half_ties = ties * 0.5  # same ties after the block scale doubles
    return torch.stack([zero, outlier, neg_zero, small, ties, half_ties]).to(dtype)


def _static_amax(x: torch.Tensor, seed: int) -> torch.Tensor:
    """A calibrated amax below the max, so some blocks saturate (as a real static scale does)."""
    return (x.float().abs().amax() * (0.3 + 0.6 * torch.rand((), generator=_gen(seed)))).reshape(())


def _channels(k: int, ratio: float, seed: int) -> torch.Tensor:
    return select_channels(torch.rand(k, generator=_gen(seed)), ratio)


def _weight(n: int, k: int, seed: int, experts: int | None = None) -> NVFP4Tensor:
    g = _gen(seed)
    shape = (n, k) if experts is None else (experts, n, k)
    w = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
    if experts is None:
        return quantize(w)
    return quantize(w, global_amax=w.float().abs().amax(dim=(1, 2)).reshape(experts, 1))  # ws2 [E, 1]


def _poisoned_prologue(tokens: int, width: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.full((tokens, width // 2), 0xFF, dtype=torch.uint8, device=device),
        torch.full((tokens, width // 16), 0xFF, dtype=torch.uint8, device=device),
        torch.full((tokens,), float("nan"), device=device),
    )


def _reference_bytes(
    x: torch.Tensor, channels: torch.Tensor, amax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scale bytes and decode scales [T] of ``[q(x), q(r_S)]`` from the PyTorch reference."""
    xq = quantize(x, global_amax=amax)
    codes, scales = xq.codes, xq.scales.view(torch.uint8)
    if channels.numel():
        residual = x.float() - xq.dequantize(torch.float32)  # as rac_operands computes it
        rq = quantize(residual[:, channels.long()], global_amax=amax)
        codes = torch.cat([codes, rq.codes], dim=1)
        scales = torch.cat([scales, rq.scales.view(torch.uint8)], dim=1)
    return codes, scales, xq.weight_scale_2.expand(x.shape[0])


def _bytes_to_values(codes: torch.Tensor, scales: torch.Tensor, width: int) -> torch.Tensor:
    t = NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), torch.ones(()), torch.Size((codes.shape[0], width)), torch.float32)
    return block_values(t)


# ----------------------------------------------------------------------------------------------
# Prologue: byte-exact activation + residual quantization
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prologue_is_byte_identical_to_the_reference(kernel_device: str, mode: ActivationScale, dtype: torch.dtype) -> None:
    k = 64 if kernel_device == "cpu" else 512
    seed = 100 * DTYPES.index(dtype) + MODES.index(mode)
    x = torch.cat([_activations(6 if kernel_device == "cpu" else 200, k, dtype, seed), _adversarial(k, dtype, seed)])
    static = _static_amax(x, seed) if mode == ActivationScale.STATIC else None
    amax = activation_amax(x, mode, static)
    for ratio in (0.0, 0.25, 1.0):
        channels = _channels(k, ratio, seed + int(ratio * 8))
        width = k + channels.numel()
        out = _poisoned_prologue(x.shape[0], width, kernel_device)
        quantize_activations_kernel(x.to(kernel_device), channels.to(kernel_device), mode, static, out=out)
        values_out = (torch.full((x.shape[0], width), float("nan"), dtype=torch.bfloat16, device=kernel_device),
                      torch.full((x.shape[0],), float("nan"), device=kernel_device))
        values, values_decode = activation_block_values_kernel(x.to(kernel_device), channels.to(kernel_device), mode,
                                                               static, out=values_out)
        codes, scales, decode = (t.cpu() for t in out)
        ref_codes, ref_scales, ref_decode = _reference_bytes(x, channels, amax)
        assert torch.equal(codes, ref_codes), f"codes differ (ratio {ratio})"
        assert torch.equal(scales, ref_scales), f"scale bytes differ (ratio {ratio})"
        assert torch.equal(decode, ref_decode)
        # and the values the GEMM multiplies are rac_operands' augmented activations
        a_values, _, _ = rac_operands(x, _weight(16, k, seed), channels, _weight(16, channels.numel(), seed) if channels.numel() else None, mode, static)
        assert torch.equal(_bytes_to_values(codes, scales, width), a_values)
        # the bf16 block values the W4A16 path multiplies: exact, so equal to them, with the same decode scale
        assert torch.equal(values.cpu().float(), a_values)
        assert torch.equal(values_decode.cpu(), ref_decode)


def test_prologue_k_order_is_the_w4a16_kernels_k_order(kernel_device: str) -> None:
    """``k_order`` writes the same block values where ``mma_k_order_rows(., 128)`` puts them, each
    part (x's K and the RAC tail) on its own 128-column blocks; K or S not a multiple of 128 is refused."""
    k = 256
    x = _activations(5 if kernel_device == "cpu" else 64, k, torch.bfloat16, 3).to(kernel_device)
    for ratio in (0.0, 0.5):
        channels = _channels(k, ratio, 4).to(kernel_device)
        values, decode = activation_block_values_kernel(x, channels)
        ordered, ordered_decode = activation_block_values_kernel(x, channels, k_order=True)
        assert torch.equal(ordered, mma_k_order_rows(values, X_ORDER_BLOCK_K))
        assert torch.equal(ordered_decode, decode)
    with pytest.raises(ValueError, match="k_order needs K and the RAC channel count multiples of 128"):
        activation_block_values_kernel(x, _channels(k, 0.25, 5).to(kernel_device), k_order=True)


def test_prologue_allocates_aligned_buffers_and_handles_no_tokens(kernel_device: str) -> None:
    k = 80
    x = _activations(3, k, torch.bfloat16, 7).to(kernel_device)
    channels = _channels(k, 0.4, 8).to(kernel_device)
    codes, scales, decode = quantize_activations_kernel(x, channels)
    assert codes.shape == (3, (k + 32) // 2) and scales.shape == (3, (k + 32) // 16) and decode.shape == (3,)
    assert codes.stride(0) % 16 == 0 and scales.stride(0) % 16 == 0
    ref_codes, ref_scales, _ = _reference_bytes(x.cpu(), channels.cpu(), activation_amax(x.cpu(), ActivationScale.PER_TOKEN))
    assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)
    empty = quantize_activations_kernel(x[:0], channels)
    assert [tuple(t.shape) for t in empty] == [(0, (k + 32) // 2), (0, (k + 32) // 16), (0,)]
    values, decode = activation_block_values_kernel(x[:0], channels)
    assert tuple(values.shape) == (0, k + 32) and values.dtype == torch.bfloat16 and tuple(decode.shape) == (0,)
    with pytest.raises(ValueError, match="out must be a bfloat16"):
        activation_block_values_kernel(x, channels, out=(torch.empty(3, k + 32, device=kernel_device), decode))
    with pytest.raises(ValueError, match="is not a valid ActivationScale"):
        activation_block_values_kernel(x, channels, mode="per_row")


# ----------------------------------------------------------------------------------------------
# GEMM: fp64 reference from the reference operands
# ----------------------------------------------------------------------------------------------


def _gemm_reference(a: torch.Tensor, a_decode: torch.Tensor, w: torch.Tensor, w_decode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, bound)``: the exact fp64 product of FP4 operands times fp32 alpha, and an error bound.

    The bound is the fp32 accumulation error ``(n + 2) u32 sum|a_i w_i| |alpha|`` (n = augmented K;
    the +2 covers the epilogue product), plus the output cast (added by the caller).
    """
    exact = a.double() @ w.double().t()  # exact: FP4 products and their sums fit in fp64
    magnitude = a.double().abs() @ w.double().abs().t()
    alpha = (a_decode.float().reshape(-1, 1) * w_decode.float().reshape(())).double()  # fp32, as the epilogue
    n = a.shape[1]
    return exact * alpha, (n + 2) * 2.0**-24 * magnitude * alpha.abs()


def _assert_close(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    u = _UNIT_ROUNDOFF[y.dtype]
    tol = bound * (1 + u) + u * ref.abs() + _SMALLEST[y.dtype]
    err = (y.double() - ref).abs()
    assert not torch.isnan(y).any(), "output has NaN: an element was not written"
    assert bool((err <= tol).all()), f"max error {float(err.max()):.3e} over tolerance (worst excess {float((err - tol).max()):.3e})"


def _shapes(device: str) -> list[tuple[int, int, int]]:
    """(M, K, N): M = 1, 5, 16, 33 (+ a prefill-sized M on GPU), K = 64, 80, 256, N off the tiles.

    Each distinct (K, |S|, tile config) is a separate compilation (K and S are constexpr), so the
    GPU list stays short too.
    """
    if device == "cpu":
        return [(1, 64, 40), (5, 80, 72), (16, 256, 40), (33, 80, 72)]
    return [(1, 64, 72), (5, 80, 1000), (16, 256, 72), (33, 80, 1000), (33, 2048, 1000), (300, 256, 1000), (1, 2048, 1000)]


@pytest.mark.parametrize("rac_gemm", (False, True), ids=("w4a16 path", "rac gemm path"))
@pytest.mark.parametrize("ratio", (0.0, 0.125, 0.5, 1.0))
def test_rac_linear_matches_the_fp64_reference(kernel_device: str, ratio: float, rac_gemm: bool) -> None:
    """The default path (the W4A16 kernels over the block values) and the RAC GEMM (a ``GemmConfig``:
    the tiles of :func:`gemm_config` for the token count)."""
    for i, (m, k, n) in enumerate(_shapes(kernel_device)):
        seed = 1000 * i + int(ratio * 64)
        x = _activations(m, k, torch.float32, seed)  # fp32 output: the tolerance is fp32-tight
        weight = _weight(n, k, seed + 1)
        channels = _channels(k, ratio, seed + 2)
        residual = reblock_columns(weight, channels) if channels.numel() else None
        out = torch.full((m, n), float("nan"), dtype=x.dtype, device=kernel_device)
        dev_residual = residual.to(kernel_device) if residual is not None else None
        y = rac_linear_kernel(x.to(kernel_device), weight.to(kernel_device), channels.to(kernel_device), dev_residual, out=out,
                              config=gemm_config(m) if rac_gemm else None)
        assert y is out
        a, a_decode, w = rac_operands(x, weight, channels, residual)
        ref, bound = _gemm_reference(a, a_decode, w, weight.weight_scale_2)
        _assert_close(y.cpu(), ref, bound)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rac_linear_modes_dtypes_and_leading_dims(kernel_device: str, mode: ActivationScale, dtype: torch.dtype) -> None:
    k, n = (64, 24) if kernel_device == "cpu" else (1024, 520)
    seed = 10 * DTYPES.index(dtype) + MODES.index(mode)
    x = torch.cat([_activations(4, k, dtype, seed), _adversarial(k, dtype, seed)[:4]]).reshape(2, 4, k)
    static = _static_amax(x, seed) if mode == ActivationScale.STATIC else None
    weight = _weight(n, k, seed + 1)
    channels = _channels(k, 0.25, seed + 2)
    residual = reblock_columns(weight, channels)
    out = torch.full((2, 4, n), float("nan"), dtype=dtype, device=kernel_device)
    rac_linear_kernel(x.to(kernel_device), weight.to(kernel_device), channels.to(kernel_device), residual.to(kernel_device), mode, static, out=out)
    a, a_decode, w = rac_operands(x.reshape(-1, k), weight, channels, residual, mode, static)
    ref, bound = _gemm_reference(a, a_decode.expand(8), w, weight.weight_scale_2)
    _assert_close(out.reshape(-1, n).cpu(), ref, bound)


@pytest.mark.parametrize(
    "config", (GemmConfig(16, 32, 64, True, 4, 2), GemmConfig(32, 16, 32, False, 4, 2), GemmConfig(16, 64, 256, False, 4, 3))
)
def test_rac_linear_tile_shapes_and_orientations(kernel_device: str, config: GemmConfig) -> None:
    k, n = 80, 40
    for m in (1, 5, 33):
        seed = 7 * m + config.block_k
        x = _activations(m, k, torch.float32, seed)
        weight = _weight(n, k, seed + 1)
        channels = _channels(k, 0.4, seed + 2)
        residual = reblock_columns(weight, channels)
        out = torch.full((m, n), float("nan"), device=kernel_device)
        dev = kernel_device
        rac_linear_kernel(x.to(dev), weight.to(dev), channels.to(dev), residual.to(dev), out=out, config=config)
        a, a_decode, w = rac_operands(x, weight, channels, residual)
        ref, bound = _gemm_reference(a, a_decode, w, weight.weight_scale_2)
        _assert_close(out.cpu(), ref, bound)


def test_rac_linear_without_tokens_and_argument_errors(kernel_device: str) -> None:
    weight = _weight(24, 64, 3).to(kernel_device)
    y = rac_linear_kernel(torch.zeros(0, 64, device=kernel_device), weight, None, None)
    assert y.shape == (0, 24)
    channels = _channels(64, 0.25, 4).to(kernel_device)
    with pytest.raises(ValueError, match="residual weight"):
        rac_linear_kernel(torch.ones(2, 64, device=kernel_device), weight, channels, None)
    with pytest.raises(ValueError, match="multiple of 16"):
        rac_linear_kernel(torch.ones(2, 64, device=kernel_device), weight, channels[:5], None)


# ----------------------------------------------------------------------------------------------
# Grouped (MoE)
# ----------------------------------------------------------------------------------------------


def _routing(experts: int, tokens: int, seed: int) -> torch.Tensor:
    """Random per-expert token counts summing to ``tokens`` with at least one empty expert."""
    g = _gen(seed)
    weights = torch.rand(experts, generator=g)
    weights[torch.randperm(experts, generator=g)[: max(1, experts // 3)]] = 0.0
    counts = torch.zeros(experts, dtype=torch.int64)
    if tokens:
        counts += torch.bincount(torch.multinomial(weights, tokens, replacement=True, generator=g), minlength=experts)
    return counts


def _stacked_residual(weight: NVFP4Tensor, channels: torch.Tensor) -> NVFP4Tensor:
    parts = [reblock_columns(expert_weight(weight, e), channels[e]) for e in range(channels.shape[0])]
    return NVFP4Tensor(
        codes=torch.stack([p.codes for p in parts]),
        scales=torch.stack([p.scales for p in parts]),
        weight_scale_2=weight.weight_scale_2,
        shape=torch.Size((channels.shape[0], weight.shape[1], channels.shape[1])),
        dtype=weight.dtype,
    )


@pytest.mark.parametrize("rac_gemm", (False, True), ids=("w4a16 path", "rac gemm path"))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ratio", (0.0, 0.25, 0.5))  # on sm_90 all run w4a16_ws (0.25: S 128 prepared as 256)
def test_grouped_rac_matches_the_per_expert_reference(
    kernel_device: str, mode: ActivationScale, ratio: float, rac_gemm: bool
) -> None:
    """Both paths as in :func:`test_rac_linear_matches_the_fp64_reference` (the RAC GEMM with the tiles
    of :func:`gemm_config` for the mean rows per expert)."""
    experts, k, n = (5, 64, 40) if kernel_device == "cpu" else (16, 512, 264)
    tokens_list = (1, 13) if kernel_device == "cpu" else (1, 13, 200, 3000)
    for j, tokens in enumerate(tokens_list):
        seed = 50 * MODES.index(mode) + 10 * j + int(ratio * 4)
        counts = _routing(experts, tokens, seed)
        offsets = expert_offsets_from_counts(counts)
        x = _activations(tokens, k, (torch.float32, torch.bfloat16)[j % 2], seed)
        static = _static_amax(x, seed) if mode == ActivationScale.STATIC else None
        weight = _weight(n, k, seed + 1, experts)
        channels = torch.stack([_channels(k, ratio, seed + 2 + e) for e in range(experts)]) if ratio else None
        residual = _stacked_residual(weight, channels) if channels is not None else None
        dev = kernel_device

        # prologue bytes, row by row with the row's expert channel set (per-expert amax in PER_TENSOR)
        if channels is not None:
            out = _poisoned_prologue(tokens, k + channels.shape[1], dev)
            quantize_activations_kernel(x.to(dev), channels.to(dev), mode, static, offsets.to(dev), out=out)
            for e in range(experts):
                lo, hi = int(offsets[e]), int(offsets[e + 1])
                if hi > lo:
                    amax = activation_amax(x[lo:hi], mode, static)
                    expected = _reference_bytes(x[lo:hi], channels[e], amax)
                    for got, want in zip(out, expected):
                        assert torch.equal(got[lo:hi].cpu(), want), f"expert {e} prologue differs"

        y = torch.full((tokens, n), float("nan"), dtype=x.dtype, device=dev)
        tail = (None, None) if channels is None else prepare_rac_tail(channels.to(dev), residual.to(dev), k, torch.device(dev))
        grouped_rac_kernel(x.to(dev), weight.to(dev), offsets.to(dev), *tail, mode, static, out=y,
                           config=gemm_config(-(-tokens // experts)) if rac_gemm else None)
        y = y.cpu()
        for e in range(experts):
            lo, hi = int(offsets[e]), int(offsets[e + 1])
            if hi == lo:
                continue
            ch = channels[e] if channels is not None else torch.zeros(0, dtype=torch.int32)
            res = expert_weight(residual, e) if residual is not None else None
            a, a_decode, w = rac_operands(x[lo:hi], expert_weight(weight, e), ch, res, mode, static)
            ref, bound = _gemm_reference(a, a_decode.expand(hi - lo), w, expert_weight(weight, e).weight_scale_2)
            _assert_close(y[lo:hi], ref, bound)
        # and the grouped reference itself, within the same bound's order (different summation order)
        reference = grouped_rac_linear(x, weight, offsets, channels, residual, mode, static)
        assert torch.allclose(y.float(), reference.float(), rtol=2**-7, atol=1e-3 * float(reference.float().abs().max()))


def _ws_grouped_runs_here() -> bool:
    """Whether the grouped dispatch hands calls to the warp-specialized kernel here (an sm_90 GPU)."""
    from megatron_quads.kernels import dispatch

    return torch.cuda.is_available() and dispatch.warp_specialized_grouped(torch.device("cuda"), 768) is not None


@pytest.mark.skipif(not _ws_grouped_runs_here(), reason="the warp-specialized grouped kernel runs on sm_90 GPUs only")
@pytest.mark.parametrize("s", (96, 192, 384))
def test_grouped_rac_down_projection_tails_run_widened_on_the_ws_kernel(
    kernel_device: str, s: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3-30B-A3B's down projection (K 768): RAC tails of 96, 192 and 384 channels are prepared
    (``prepare_rac_tail``) as whole 256-column ring steps (repeated channels, zero ``W_S`` columns)
    and run on the warp-specialized kernel; every expert's rows match the fp64 product of the
    reference operands of the narrow tail."""
    from megatron_quads.kernels import dispatch

    experts, k, n = 8, 768, 256
    ws = dispatch.gluon_module("w4a16_ws")
    tails = []
    run = ws.grouped_w4a16_ws_into

    def spy(*args, **kwargs):
        tails.append(kwargs.get("tail"))
        return run(*args, **kwargs)

    monkeypatch.setattr(ws, "grouped_w4a16_ws_into", spy)
    for j, tokens in enumerate((64, 600)):
        seed = 700 + s + j
        counts = _routing(experts, tokens, seed)
        offsets = expert_offsets_from_counts(counts)
        x = _activations(tokens, k, torch.bfloat16, seed)
        weight = _weight(n, k, seed + 1, experts)
        channels = torch.stack([_channels(k, s / k, seed + 2 + e) for e in range(experts)])
        residual = _stacked_residual(weight, channels)
        y = torch.full((tokens, n), float("nan"), dtype=x.dtype, device=kernel_device)
        device = torch.device(kernel_device)
        tail = prepare_rac_tail(channels.to(device), residual.to(device), k, device)
        assert tail[0].shape[1] == 256 * -(-s // 256)
        grouped_rac_kernel(x.to(device), weight.to(device), offsets.to(device), *tail, out=y)
        assert tails and tails[-1] is not None and tails[-1].shape[-1] == 256 * -(-s // 256), "not widened onto ws"
        y = y.cpu()
        for e in range(experts):
            lo, hi = int(offsets[e]), int(offsets[e + 1])
            if hi == lo:
                continue
            a, a_decode, w = rac_operands(x[lo:hi], expert_weight(weight, e), channels[e], expert_weight(residual, e))
            ref, bound = _gemm_reference(a, a_decode.expand(hi - lo), w, expert_weight(weight, e).weight_scale_2)
            _assert_close(y[lo:hi], ref, bound)


@pytest.mark.parametrize("rac_gemm", (False, True), ids=("w4a16 path", "rac gemm path"))
def test_grouped_rac_takes_a_widened_tail_as_given(kernel_device: str, rac_gemm: bool) -> None:
    """A tail widened by ``padded_tail`` (repeated channels, zero ``W_S`` columns) runs as given on
    either GEMM path, and every expert's rows match the fp64 product of the narrow tail's operands."""
    import megatron_quads.kernels.w4a4 as w4a4_kernels

    experts, k, n, tokens = 3, 64, 24, 11
    counts = _routing(experts, tokens, 31)
    offsets = expert_offsets_from_counts(counts)
    x = _activations(tokens, k, torch.bfloat16, 32)
    weight = _weight(n, k, 33, experts)
    channels = torch.stack([_channels(k, 0.25, 34 + e) for e in range(experts)])
    residual = _stacked_residual(weight, channels)
    wide_channels, wide_residual = w4a4_kernels.padded_tail(channels, residual, 48)
    dev = torch.device(kernel_device)
    y = torch.full((tokens, n), float("nan"), dtype=x.dtype, device=dev)
    grouped_rac_kernel(x.to(dev), weight.to(dev), offsets.to(dev), wide_channels.to(dev), wide_residual.to(dev), out=y,
                       config=gemm_config(-(-tokens // experts)) if rac_gemm else None)
    y = y.cpu()
    for e in range(experts):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi > lo:
            a, a_decode, w = rac_operands(x[lo:hi], expert_weight(weight, e), channels[e], expert_weight(residual, e))
            ref, bound = _gemm_reference(a, a_decode.expand(hi - lo), w, expert_weight(weight, e).weight_scale_2)
            _assert_close(y[lo:hi], ref, bound)


def test_grouped_with_all_tokens_in_one_expert_and_no_tokens(kernel_device: str) -> None:
    experts, k, n = 4, 64, 24
    weight = _weight(n, k, 21, experts).to(kernel_device)
    counts = torch.tensor([0, 0, 7, 0])
    offsets = expert_offsets_from_counts(counts).to(kernel_device)
    x = _activations(7, k, torch.float16, 22)
    y = grouped_rac_kernel(x.to(kernel_device), weight, offsets)
    a, a_decode, w = rac_operands(x, expert_weight(weight.to("cpu"), 2), torch.zeros(0, dtype=torch.int32), None)
    ref, bound = _gemm_reference(a, a_decode, w, expert_weight(weight.to("cpu"), 2).weight_scale_2)
    _assert_close(y.cpu(), ref, bound)
    empty = grouped_rac_kernel(x[:0].to(kernel_device), weight, torch.zeros(experts + 1, dtype=torch.int32, device=kernel_device))
    assert empty.shape == (0, n)
