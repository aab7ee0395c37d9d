"""Triton W4A16 kernels (dense and grouped MoE) against an fp64 oracle and the PyTorch references.

Two kinds of checks:

* exact: weights with a limited scale range and activations on a coarse grid make every product
  and every partial sum an integer multiple of one unit below 2^22 units, so fp32 accumulation is
  exact in any order (split-K and tensor-core chunking included). The only roundings left are the
  epilogue's ``acc * weight_scale_2`` and the cast, so the kernel must match the oracle bit for bit:
  any wrongly decoded code or scale, any dropped or doubled K tile changes the result.
* bounded: realistic weights (``quantize`` of Gaussians, and raw random codes with every scale
  byte) against ``x.double() @ dq(W).double().T * weight_scale_2``, within the worst case of fp32
  accumulation (``K`` additions, each off by at most one ulp, i.e. ``2^-23`` of the sum of
  ``|x||w|``), the ``weight_scale_2`` product and the final cast (half an ulp of the output dtype).

Outputs are poisoned (NaN) before each run and the split-K workspace is poisoned too.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

pytest.importorskip("triton")

from megatron_quads.nvfp4 import NVFP4Tensor, quantize
from megatron_quads.kernels import w4a16
from megatron_quads.rollout.grouped import (
    expert_offsets_from_counts,
    grouped_w4a16_linear,
)
from megatron_quads.rollout.w4a4 import block_values, w4a16_linear

DTYPES = [torch.bfloat16]  # fp16 is disabled in the kernel (see w4a16._KERNEL_DTYPES)
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SMALLEST_SUBNORMAL = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}

ON_CUDA = torch.cuda.is_available()
"""Where the kernel_device fixture puts tensors; on the GPU the configs are real tile sizes (each
distinct one compiles for every token bucket and dtype, so the list is short)."""

if ON_CUDA:
    DENSE_CONFIGS: list[dict[str, int] | None] = [
        {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 4},
        {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 3, "num_warps": 4, "num_stages": 3},
        {"BLOCK_N": 256, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 8, "num_stages": 4},
    ]
    GROUPED_CONFIGS: list[dict[str, int] | None] = [
        {"BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_M": 16, "num_warps": 4, "num_stages": 4},
        {"BLOCK_N": 64, "BLOCK_K": 256, "BLOCK_M": 64, "num_warps": 4, "num_stages": 3},
    ]
else:
    DENSE_CONFIGS = [
        None,  # the autotuned path (a single small config under the interpreter)
        {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1},
        {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 3},
        {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2},
    ]
    GROUPED_CONFIGS = [
        None,
        {"BLOCK_N": 16, "BLOCK_K": 64, "BLOCK_M": 16},
        {"BLOCK_N": 32, "BLOCK_K": 128, "BLOCK_M": 32},
    ]


def _config_id(config: dict[str, int] | None) -> str:
    return "autotune" if config is None else "-".join(f"{k[0]}{k[-1]}{v}" for k, v in config.items())


@pytest.fixture
def poisoned_partials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fill the split-K workspace with NaN, so a partial read before it was written shows."""

    def new_partials(numel: int, device: torch.device) -> torch.Tensor:
        return torch.full((numel,), float("nan"), dtype=torch.float32, device=device)

    monkeypatch.setattr(w4a16, "_new_partials", new_partials)


# --------------------------------------------------------------------------------------------------
# Inputs and oracle
# --------------------------------------------------------------------------------------------------


def _gaussian_weight(shape: tuple[int, ...], device: str) -> NVFP4Tensor:
    """``quantize`` of Gaussians with a wide per-row spread; one amax per expert when stacked."""
    w = torch.randn(shape, device=device) * torch.logspace(-2, 2, shape[-2], device=device).unsqueeze(-1)
    w[..., 0, :16] = 0.0  # an all-zero block (scale byte 0)
    amax = w.abs().amax(dim=(-2, -1)).unsqueeze(-1) if len(shape) == 3 else None
    return quantize(w, global_amax=amax)


def _raw_weight(
    shape: tuple[int, ...], device: str, scale_bytes: tuple[int, int] = (0x00, 0x7E), decode: float | None = None
) -> NVFP4Tensor:
    """Random codes (every byte value) and scale bytes in ``scale_bytes`` (default: every finite
    E4M3, subnormals included); decode scales ``decode``, or random positive fp32 ones (one per
    expert when stacked)."""
    *lead, k = shape
    codes = torch.randint(0, 256, (*lead, k // 2), dtype=torch.uint8, device=device)
    scales = torch.randint(scale_bytes[0], scale_bytes[1] + 1, (*lead, k // 16), dtype=torch.uint8, device=device)
    ws2_shape = (shape[0], 1) if len(shape) == 3 else ()
    ws2 = torch.rand(ws2_shape, dtype=torch.float32, device=device) * 1e-3 + 1e-5
    if decode is not None:
        ws2 = torch.full_like(ws2, decode)
    return NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), ws2, torch.Size(shape), torch.bfloat16)


def _activations(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    x = torch.randn(shape, device=device) * torch.logspace(-1, 1, shape[-1], device=device)
    return x.to(dtype)


def _grid_activations(shape: tuple[int, ...], dtype: torch.dtype, device: str, bound: int) -> torch.Tensor:
    """Integers in ``[-bound, bound]`` times 2^-2: exact in bf16 and fp16, unit 2^-2."""
    return (torch.randint(-bound, bound + 1, shape, device=device).float() * 0.25).to(dtype)


def _expert(weight: NVFP4Tensor, e: int) -> NVFP4Tensor:
    ws2 = weight.weight_scale_2.reshape(-1)
    return NVFP4Tensor(weight.codes[e], weight.scales[e], ws2[e if ws2.numel() > 1 else 0], weight.shape[1:], weight.dtype)


def _oracle(x: torch.Tensor, weight: NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``(x @ dq(W).T, |x| @ |dq(W)|.T)`` for ``x [..., K]`` and an ``[N, K]`` weight."""
    wv = block_values(weight).double()
    ws2 = weight.weight_scale_2.double()
    xd = x.double()
    return (xd @ wv.t()) * ws2, (xd.abs() @ wv.abs().t()) * ws2


def _tolerance(exact: torch.Tensor, magnitude: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Worst case of fp32 accumulation over ``k`` terms, the fp32 epilogue product and the cast."""
    acc = k * 2.0**-23 * magnitude + 2.0**-24 * exact.abs()
    return acc + UNIT_ROUNDOFF[dtype] * (exact.abs() + acc) + SMALLEST_SUBNORMAL[dtype]


def _assert_within(y: torch.Tensor, exact: torch.Tensor, tol: torch.Tensor) -> None:
    assert torch.isfinite(y).all(), "output has NaN/Inf: some element was not written"
    err = (y.double() - exact).abs()
    worst = (err / tol).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"error up to {worst:.3g}x the tolerance (max abs err {err.max().item():.3g})"


def _power_of_two_unit(t: torch.Tensor) -> float:
    """The largest power of two that divides every element of ``t`` (not all zero)."""
    values = t.abs().flatten()
    values = values[values > 0]
    unit = 2.0 ** math.floor(math.log2(values.min().item()))
    while not torch.equal(torch.round(values / unit), values / unit):
        unit /= 2
    return unit


def _exact_expected(x: torch.Tensor, weight: NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's result when fp32 accumulation is exact: ``cast(fp32(sum) * ws2)``."""
    wv = block_values(weight).double()
    xd = x.double()
    total, magnitude = xd @ wv.t(), xd.abs() @ wv.abs().t()
    unit = _power_of_two_unit(xd) * _power_of_two_unit(wv)  # every product is a multiple of it
    assert magnitude.max().item() / unit < 2.0**22, "test inputs do not keep fp32 sums exact"
    assert torch.equal(total.float().double(), total)
    return (total.float() * weight.weight_scale_2.float()).to(dtype)


def _bf16_ties(x: torch.Tensor, weight: NVFP4Tensor) -> int:
    """How many fp32 results ``fp32(sum) * ws2`` lie exactly halfway between two bf16 values."""
    total = x.double() @ block_values(weight).double().t()
    bits = (total.float() * weight.weight_scale_2.float()).view(torch.int32)
    return int(((bits & 0xFFFF) == 0x8000).sum())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _dense_run(x: torch.Tensor, weight: NVFP4Tensor, config: dict[str, int] | None) -> torch.Tensor:
    out = torch.full((*x.shape[:-1], weight.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    result = w4a16.w4a16_linear_into(x, weight, out, config)
    assert result is out
    assert all(int(c.abs().sum()) == 0 for c in w4a16._COUNTERS.values()), "split-K counters were not reset"
    return out


def _dense_shapes(device: str) -> list[tuple[int, int, int]]:
    """(M, N, K): token counts 1, 3, 16, 17, 64 and 130 (several token tiles, the no-split-K
    autotuner); N and K not multiples of the tiles."""
    shapes = [(1, 40, 48), (3, 72, 80), (16, 40, 80), (17, 24, 48), (64, 72, 128), (130, 40, 48)]
    if device == "cuda":
        shapes += [(1, 4096 + 40, 2048 + 48), (16, 2048, 4096), (17, 1536, 2048 + 80), (64, 4096, 4096), (200, 2048, 2048)]
    return shapes


# --------------------------------------------------------------------------------------------------
# Dense
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", DENSE_CONFIGS, ids=_config_id)
def test_dense_exact_on_exactly_summable_inputs(
    kernel_device: str, dtype: torch.dtype, config: dict[str, int] | None, poisoned_partials: None
) -> None:
    ties = 0
    for m, n, k in _dense_shapes(kernel_device):
        # decode 2^-7 keeps the fp32 results' low bits, so many sit exactly between two bf16 values
        for decode in (None, 2.0**-7):
            weight = _raw_weight((n, k), kernel_device, scale_bytes=(0x28, 0x4F), decode=decode)  # scales 2^-2 .. 7.5
            x = _grid_activations((m, k), dtype, kernel_device, bound=8 if k <= 256 else 1)
            expected = _exact_expected(x, weight, dtype)
            assert _same_bits(_dense_run(x, weight, config), expected), (m, n, k, decode)
            ties += _bf16_ties(x, weight)
    assert dtype != torch.bfloat16 or ties > 0, "no rounding ties were exercised"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", DENSE_CONFIGS, ids=_config_id)
def test_dense_within_fp32_accumulation_error(
    kernel_device: str, dtype: torch.dtype, config: dict[str, int] | None, poisoned_partials: None
) -> None:
    for m, n, k in _dense_shapes(kernel_device):
        for weight in (_gaussian_weight((n, k), kernel_device), _raw_weight((n, k), kernel_device)):
            x = _activations((m, k), dtype, kernel_device)
            exact, magnitude = _oracle(x, weight)
            _assert_within(_dense_run(x, weight, config), exact, _tolerance(exact, magnitude, k, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_leading_dims_and_strided_rows(kernel_device: str, dtype: torch.dtype) -> None:
    n, k = 40, 80
    for lead in [(2, 3), (2, 9), (1, 1, 5)]:
        weight = _gaussian_weight((n, k), kernel_device)
        x = _activations((*lead, k), dtype, kernel_device)
        y = w4a16.w4a16_linear_kernel(x, weight)
        assert y.shape == (*lead, n) and y.dtype == dtype
        exact, magnitude = _oracle(x, weight)
        _assert_within(y, exact, _tolerance(exact, magnitude, k, dtype))
    wide = _activations((7, 2 * k), dtype, kernel_device)
    x = wide[:, :k]  # row stride 2K
    exact, magnitude = _oracle(x, weight)
    _assert_within(_dense_run(x, weight, None), exact, _tolerance(exact, magnitude, k, dtype))
    x = wide[:, ::2]  # K stride 2: copied to unit stride
    exact, magnitude = _oracle(x, weight)
    _assert_within(_dense_run(x, weight, None), exact, _tolerance(exact, magnitude, k, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_agrees_with_reference(kernel_device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_QUADS_KERNELS", "0")  # the reference must not dispatch to the kernel
    for m, n, k in _dense_shapes(kernel_device):
        weight = _gaussian_weight((n, k), kernel_device)
        x = _activations((m, k), dtype, kernel_device)
        exact, magnitude = _oracle(x, weight)
        tol = _tolerance(exact, magnitude, k, dtype)
        y = w4a16.w4a16_linear_kernel(x, weight)
        reference = w4a16_linear(x, weight)
        assert reference.dtype == y.dtype == dtype and reference.shape == y.shape
        _assert_within(reference, exact, tol)  # the reference rounds w * ws2 per element: same bound
        assert ((y.double() - reference.double()).abs() <= 2 * tol).all()


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_propagates_inf_and_nan(kernel_device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inf times a zero weight gives NaN, times a nonzero one +-Inf, as in the reference."""
    monkeypatch.setenv("MEGATRON_QUADS_KERNELS", "0")
    weight = _gaussian_weight((40, 80), kernel_device)  # row 0 starts with a zero block
    x = _activations((5, 80), dtype, kernel_device)
    x[1, 3] = float("inf")
    x[2, 40] = -float("inf")
    x[3, 7] = float("nan")
    y = _dense_run(x, weight, None)
    reference = w4a16_linear(x, weight)
    assert torch.equal(torch.isnan(y), torch.isnan(reference)) and torch.isnan(y[1, 0])
    assert torch.equal(torch.isinf(y), torch.isinf(reference)) and torch.isinf(y[2]).any()
    finite = torch.isfinite(reference)
    assert torch.equal(torch.sign(y[torch.isinf(y)]), torch.sign(reference[torch.isinf(reference)]))
    assert finite[[0, 4]].all()


@pytest.mark.gpu
def test_dense_rejects_fp32_and_handles_empty(kernel_device: str) -> None:
    weight = _gaussian_weight((40, 48), kernel_device)
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(TypeError, match="bfloat16 activations"):
            w4a16.w4a16_linear_kernel(torch.randn(3, 48, device=kernel_device, dtype=dtype), weight)
    with pytest.raises(ValueError, match="input features"):
        w4a16.w4a16_linear_kernel(torch.randn(3, 32, device=kernel_device).bfloat16(), weight)
    y = w4a16.w4a16_linear_kernel(torch.randn(0, 48, device=kernel_device).bfloat16(), weight)
    assert y.shape == (0, 40)
    x = torch.randn(3, 48, device=kernel_device).bfloat16()
    with pytest.raises(ValueError, match="BLOCK_K must be a multiple of 64"):
        w4a16.w4a16_linear_into(x, weight, torch.empty(3, 40, device=kernel_device, dtype=torch.bfloat16),
                                {"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1})


@pytest.mark.gpu
def test_augmented_rejects_mismatched_parts(kernel_device: str) -> None:
    """The W4A4 + RAC entry point names the part that does not fit (its results are checked against
    the fp64 reference in test_kernels_w4a4.py)."""
    weight = _gaussian_weight((40, 48), kernel_device)
    tail = _gaussian_weight((40, 32), kernel_device)
    values = torch.randn(3, 80, device=kernel_device).bfloat16()
    scale = torch.ones(3, device=kernel_device)
    out = torch.empty(3, 40, device=kernel_device)
    with pytest.raises(ValueError, match="tail weight must be"):
        w4a16.w4a16_augmented_into(values, weight, _gaussian_weight((24, 32), kernel_device), scale, out)
    with pytest.raises(ValueError, match="input features"):
        w4a16.w4a16_augmented_into(values[:, :64], weight, tail, scale, out)
    with pytest.raises(ValueError, match="row_scale"):
        w4a16.w4a16_augmented_into(values, weight, tail, scale.double(), out)
    with pytest.raises(ValueError, match="out must be"):
        w4a16.w4a16_augmented_into(values, weight, tail, scale, out[:, :8])
    stacked = _gaussian_weight((2, 40, 48), kernel_device)
    offsets = expert_offsets_from_counts(torch.tensor([1, 2])).to(kernel_device)
    with pytest.raises(ValueError, match="tail weight must be"):
        w4a16.grouped_w4a16_into(values, stacked, offsets, out, tail=tail, row_scale=scale)
    with pytest.raises(ValueError, match="row_scale"):
        w4a16.grouped_w4a16_into(values, stacked, offsets, out, tail=_gaussian_weight((2, 40, 32), kernel_device),
                                 row_scale=scale[:2])


# --------------------------------------------------------------------------------------------------
# Grouped
# --------------------------------------------------------------------------------------------------


def _grouped_cases(device: str) -> list[tuple[list[int], int, int]]:
    """(tokens per expert, N, K): empty experts, one expert with everything, E = 1, > BLOCK_M rows,
    experts on either side of half a token tile (the half-width tile: 16 rows runs it at BLOCK_M 32)."""
    cases = [([3, 0, 17, 5], 40, 48), ([0, 0, 20, 0], 24, 80), ([7], 72, 64), ([0, 40, 0, 1, 0], 40, 80),
             ([16, 0, 33, 1, 32], 24, 64)]
    if device == "cuda":
        counts = torch.distributions.Categorical(logits=torch.randn(128) * 1.5).sample((512 * 8,))
        cases += [(torch.bincount(counts, minlength=128).tolist(), 1536, 2048), ([0] * 15 + [200], 768 + 40, 2048 + 48)]
    return cases


def _grouped_oracle(x: torch.Tensor, weight: NVFP4Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    exact = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.float64, device=x.device)
    magnitude = torch.zeros_like(exact)
    start = 0
    for e, rows in enumerate(counts):
        exact[start : start + rows], magnitude[start : start + rows] = _oracle(x[start : start + rows], _expert(weight, e))
        start += rows
    return exact, magnitude


def _with_ws2(weight: NVFP4Tensor, layout: str) -> NVFP4Tensor:
    """The same weight with ``weight_scale_2`` as ``[E, 1]``, ``[E]`` or one shared 0-dim value."""
    ws2 = weight.weight_scale_2.reshape(-1)
    new = {"E1": ws2.reshape(-1, 1), "E": ws2, "shared": ws2[0].clone()}[layout]
    return NVFP4Tensor(weight.codes, weight.scales, new, weight.shape, weight.dtype)


def _grouped_run(x: torch.Tensor, weight: NVFP4Tensor, counts: list[int], config: dict[str, int] | None,
                 x_mma_order: bool = False) -> torch.Tensor:
    """The grouped kernel into a NaN-filled output; with ``x_mma_order`` on x put in its K order first."""
    offsets = expert_offsets_from_counts(torch.tensor(counts)).to(x.device)
    out = torch.full((x.shape[0], weight.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    if x_mma_order:
        x = w4a16.mma_k_order_rows(x, w4a16.X_ORDER_BLOCK_K)
    assert w4a16.grouped_w4a16_into(x, weight, offsets, out, config, x_mma_order=x_mma_order) is out
    return out


def assert_grouped_exact(y: torch.Tensor, x: torch.Tensor, weight: NVFP4Tensor, counts: list[int]) -> None:
    """Each expert's rows of ``y`` are bit for bit the exact product of its rows of ``x`` (exactly summable inputs)."""
    start = 0
    for e, rows in enumerate(counts):
        if rows:
            expected = _exact_expected(x[start : start + rows], _expert(weight, e), y.dtype)
            assert _same_bits(y[start : start + rows], expected), (counts, e)
        start += rows


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", GROUPED_CONFIGS, ids=_config_id)
def test_grouped_exact_on_exactly_summable_inputs(kernel_device: str, dtype: torch.dtype, config: dict[str, int] | None) -> None:
    for counts, n, k in _grouped_cases(kernel_device):
        weight = _raw_weight((len(counts), n, k), kernel_device, scale_bytes=(0x28, 0x4F))
        x = _grid_activations((sum(counts), k), dtype, kernel_device, bound=8 if k <= 256 else 1)
        assert_grouped_exact(_grouped_run(x, weight, counts, config), x, weight, counts)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", GROUPED_CONFIGS, ids=_config_id)
@pytest.mark.parametrize("ws2_layout", ["E1", "E", "shared"])
def test_grouped_within_fp32_accumulation_error(
    kernel_device: str, dtype: torch.dtype, config: dict[str, int] | None, ws2_layout: str
) -> None:
    for counts, n, k in _grouped_cases(kernel_device):
        for weight in (_gaussian_weight((len(counts), n, k), kernel_device), _raw_weight((len(counts), n, k), kernel_device)):
            weight = _with_ws2(weight, ws2_layout)
            x = _activations((sum(counts), k), dtype, kernel_device)
            exact, magnitude = _grouped_oracle(x, weight, counts)
            _assert_within(_grouped_run(x, weight, counts, config), exact, _tolerance(exact, magnitude, k, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ws2_layout", ["E1", "E"])
def test_grouped_agrees_with_reference(
    kernel_device: str, dtype: torch.dtype, ws2_layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEGATRON_QUADS_KERNELS", "0")
    for counts, n, k in _grouped_cases(kernel_device):
        weight = _with_ws2(_gaussian_weight((len(counts), n, k), kernel_device), ws2_layout)
        x = _activations((sum(counts), k), dtype, kernel_device)
        offsets = expert_offsets_from_counts(torch.tensor(counts)).to(kernel_device)
        y = w4a16.grouped_w4a16_kernel(x, weight, offsets)
        reference = grouped_w4a16_linear(x, weight, offsets)
        exact, magnitude = _grouped_oracle(x, weight, counts)
        tol = _tolerance(exact, magnitude, k, dtype)
        _assert_within(y, exact, tol)
        _assert_within(reference, exact, tol)
        assert ((y.double() - reference.double()).abs() <= 2 * tol).all()


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [32, 64])
def test_grouped_half_tile_gives_the_full_tiles_bits(kernel_device: str, block_m: int) -> None:
    """Experts with at most ``BLOCK_M / 2`` rows run the half-width token tile: the same products in
    the same order as a full-width tile, so the same bits. With ``BLOCK_M`` doubled every expert of
    this routing takes a tile of ``block_m`` or more columns instead; the rows past half a tile and
    the tail (RAC) give the same bits too."""
    half = block_m // 2
    counts = [half, 0, half + 1, 1, block_m + 3, 2]
    n, k, k2 = 48, 128, 64
    weight = _gaussian_weight((len(counts), n, k), kernel_device)
    tail = _gaussian_weight((len(counts), n, k2), kernel_device)
    x = _activations((sum(counts), k + k2), torch.bfloat16, kernel_device)
    row_scale = torch.rand(sum(counts), device=kernel_device) + 0.5
    offsets = expert_offsets_from_counts(torch.tensor(counts)).to(kernel_device)
    outputs = {}
    for tile in (block_m, 2 * block_m):
        config = {"BLOCK_N": 32 if kernel_device == "cpu" else 64, "BLOCK_K": 64, "BLOCK_M": tile}
        plain = torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16, device=kernel_device)
        rac = torch.full_like(plain, float("nan"))
        w4a16.grouped_w4a16_into(x[:, :k], weight, offsets, plain, config)
        w4a16.grouped_w4a16_into(x, weight, offsets, rac, config, tail=tail, row_scale=row_scale)
        outputs[tile] = (plain, rac)
    for narrow, wide in zip(outputs[block_m], outputs[2 * block_m]):
        assert not narrow.isnan().any()
        assert _same_bits(narrow, wide)
    assert w4a16._half_tile({"BLOCK_M": block_m}) and not w4a16._half_tile({"BLOCK_M": 16})


@pytest.mark.gpu
def test_grouped_validation_and_empty(kernel_device: str) -> None:
    weight = _gaussian_weight((3, 40, 48), kernel_device)
    offsets = expert_offsets_from_counts(torch.tensor([1, 0, 2])).to(kernel_device)
    x = torch.randn(3, 48, device=kernel_device)
    with pytest.raises(TypeError, match="bfloat16 activations"):
        w4a16.grouped_w4a16_kernel(x, weight, offsets)
    with pytest.raises(ValueError, match="expert_offsets"):
        w4a16.grouped_w4a16_kernel(x.bfloat16(), weight, offsets[:-1])
    with pytest.raises(ValueError, match="stacked"):
        w4a16.grouped_w4a16_kernel(x.bfloat16(), _gaussian_weight((40, 48), kernel_device), offsets)
    empty = torch.zeros(4, dtype=torch.int32, device=kernel_device)
    assert w4a16.grouped_w4a16_kernel(x[:0].bfloat16(), weight, empty).shape == (0, 40)
    with pytest.raises(ValueError, match="BLOCK_K must be a multiple of 64"):
        w4a16.grouped_w4a16_into(x.bfloat16(), weight, offsets, torch.empty(3, 40, device=kernel_device, dtype=torch.bfloat16),
                                 {"BLOCK_N": 32, "BLOCK_K": 96})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisation is a CUDA notion (not under the interpreter)")
def test_launches_without_host_sync(kernel_device: str) -> None:
    weight = _gaussian_weight((8, 256, 512), kernel_device)
    offsets = expert_offsets_from_counts(torch.tensor([5, 0, 9, 1, 0, 0, 30, 3])).to(kernel_device)
    x = _activations((48, 512), torch.bfloat16, kernel_device)
    dense_weight = _gaussian_weight((256, 512), kernel_device)
    w4a16.grouped_w4a16_kernel(x, weight, offsets)  # compilation (which synchronises) happens here
    w4a16.w4a16_linear_kernel(x[:16], dense_weight)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w4a16.grouped_w4a16_kernel(x, weight, offsets)
        w4a16.w4a16_linear_kernel(x[:16], dense_weight)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ----------------------------------------------------------------------------------------- x in the MMA K order


def test_mma_k_order_rows_is_the_kernel_permutation() -> None:
    """:func:`w4a16.mma_k_order_rows` puts element ``8 (I t + i) + 4 h + 2 q1 + q0`` of each run at
    ``32 i + 16 q1 + 8 q0 + 2 t + h`` (what ``mma_k_order_x`` does to a loaded tile), run by run."""
    for block_k in (64, 128, 256):
        x = torch.arange(3 * 2 * block_k, dtype=torch.float32).reshape(3, 2 * block_k)
        y = w4a16.mma_k_order_rows(x, block_k)
        i_runs = block_k // 32
        for kt, t, i, h, q1, q0 in itertools.product(range(2), range(4), range(i_runs), range(2), range(2), range(2)):
            new = kt * block_k + 32 * i + 16 * q1 + 8 * q0 + 2 * t + h
            old = kt * block_k + 8 * (i_runs * t + i) + 4 * h + 2 * q1 + q0
            assert torch.equal(y[:, new], x[:, old]), (block_k, kt, t, i, h, q1, q0)
    with pytest.raises(ValueError, match="multiple of 64 dividing K"):
        w4a16.mma_k_order_rows(torch.zeros(2, 192), 128)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    None,  # the x-order autotuner
    {"BLOCK_N": 32, "BLOCK_K": 128, "BLOCK_M": 16, "num_warps": 4, "num_stages": 2},
    {"BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_M": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 256, "BLOCK_K": 128, "BLOCK_M": 32, "num_warps": 8, "num_stages": 3},
], ids=_config_id)
def test_grouped_x_in_mma_order(kernel_device: str, config: dict[str, int] | None) -> None:
    """``x_mma_order`` on x put in the kernel's K order: with a given config the natural-order kernel's
    output bit for bit (the same products in the same order); always exact on exactly summable inputs
    and within the fp32 bound on realistic ones."""
    cases = [([3, 0, 17, 5], 40, 512), ([0, 70, 0, 1], 72, 256)]
    if kernel_device == "cuda":
        counts = torch.distributions.Categorical(logits=torch.randn(128) * 1.5).sample((512 * 8,))
        cases.append((torch.bincount(counts, minlength=128).tolist(), 1536, 2048))
    for counts, n, k in cases:
        weight = _raw_weight((len(counts), n, k), kernel_device, scale_bytes=(0x28, 0x4F))
        x = _grid_activations((sum(counts), k), torch.bfloat16, kernel_device, bound=8 if k <= 256 else 1)
        ordered = _grouped_run(x, weight, counts, config, x_mma_order=True)
        if config is not None:
            assert _same_bits(ordered, _grouped_run(x, weight, counts, config)), (counts, n, k)
        assert_grouped_exact(ordered, x, weight, counts)
        weight = _gaussian_weight((len(counts), n, k), kernel_device)
        x = _activations((sum(counts), k), torch.bfloat16, kernel_device)
        exact, magnitude = _grouped_oracle(x, weight, counts)
        _assert_within(_grouped_run(x, weight, counts, config, x_mma_order=True), exact,
                       _tolerance(exact, magnitude, k, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, {"BLOCK_N": 32, "BLOCK_K": 128, "BLOCK_M": 16, "num_warps": 4, "num_stages": 2}],
                         ids=_config_id)
def test_grouped_x_in_mma_order_with_a_tail_and_row_scale(kernel_device: str, config: dict[str, int] | None) -> None:
    """The W4A4 + RAC form (a tail weight over ``K2`` more columns of x, a row scale) with x, tail
    included, in the K order: with a given config the natural-order kernel's output bit for bit, and
    within the fp32 bound of it from the autotuner."""
    for counts, n, k, k2 in (([3, 0, 17, 5], 40, 256, 128), ([0, 70, 0, 1], 72, 128, 256)):
        weight = _gaussian_weight((len(counts), n, k), kernel_device)
        part = _gaussian_weight((len(counts), n, k2), kernel_device)
        tail = NVFP4Tensor(codes=part.codes, scales=part.scales, weight_scale_2=weight.weight_scale_2, shape=part.shape,
                           dtype=part.dtype)
        x = _activations((sum(counts), k + k2), torch.bfloat16, kernel_device)
        row_scale = torch.rand(x.shape[0], device=kernel_device) + 0.5
        offsets = expert_offsets_from_counts(torch.tensor(counts)).to(kernel_device)
        natural, ordered = (torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16, device=kernel_device)
                            for _ in range(2))
        w4a16.grouped_w4a16_into(x, weight, offsets, natural, config, tail=tail, row_scale=row_scale)
        w4a16.grouped_w4a16_into(w4a16.mma_k_order_rows(x, w4a16.X_ORDER_BLOCK_K), weight, offsets, ordered, config,
                                 tail=tail, row_scale=row_scale, x_mma_order=True)
        if config is not None:
            assert _same_bits(ordered, natural), (counts, n, k, k2)
        scale = float(natural.float().abs().max())
        assert torch.allclose(ordered.float(), natural.float(), rtol=2**-7, atol=1e-3 * scale), (counts, n, k, k2)
    with pytest.raises(ValueError, match="the tail's K2 % 128 == 0"):
        w4a16.grouped_w4a16_into(torch.zeros(3, k + 192, dtype=torch.bfloat16, device=kernel_device), weight, offsets,
                                 torch.empty(3, n, dtype=torch.bfloat16, device=kernel_device),
                                 tail=_gaussian_weight((len(counts), n, 192), kernel_device), x_mma_order=True)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    None,
    {"BLOCK_N": 32, "BLOCK_K": 64, "BLOCK_M": 32, "num_warps": 4, "num_stages": 2},
    {"BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_M": 16, "num_warps": 4, "num_stages": 3},
], ids=_config_id)
def test_grouped_y_in_mma_order(kernel_device: str, config: dict[str, int] | None) -> None:
    """``y_mma_order`` writes each output row in the K order of :func:`mma_k_order_rows`: the
    natural output reordered, bit for bit, for N of one and of several blocks."""
    for counts, n in (([3, 0, 17, 5], 128), ([0, 40, 1], 384)):
        weight = _gaussian_weight((len(counts), n, 64), kernel_device)
        x = _activations((sum(counts), 64), torch.bfloat16, kernel_device)
        offsets = expert_offsets_from_counts(torch.tensor(counts)).to(kernel_device)
        natural = _grouped_run(x, weight, counts, config)
        ordered = torch.full_like(natural, float("nan"))
        w4a16.grouped_w4a16_into(x, weight, offsets, ordered, config, y_mma_order=True)
        assert not torch.equal(ordered, natural)
        assert _same_bits(ordered, w4a16.mma_k_order_rows(natural, w4a16.X_ORDER_BLOCK_K)), (counts, n)
    with pytest.raises(ValueError, match="y_mma_order needs N % 128 == 0"):
        w4a16.grouped_w4a16_kernel(x, _gaussian_weight((3, 192, 64), kernel_device), offsets, y_mma_order=True)


@pytest.mark.gpu
def test_grouped_x_order_argument_errors(kernel_device: str) -> None:
    weight = _gaussian_weight((2, 40, 192), kernel_device)
    offsets = expert_offsets_from_counts(torch.tensor([1, 2])).to(kernel_device)
    x = torch.zeros(3, 192, dtype=torch.bfloat16, device=kernel_device)
    with pytest.raises(ValueError, match="x_mma_order needs K % 128 == 0"):
        w4a16.grouped_w4a16_kernel(x, weight, offsets, x_mma_order=True)
    weight = _gaussian_weight((2, 40, 256), kernel_device)
    with pytest.raises(ValueError, match="BLOCK_K 128 in a given config"):
        w4a16.grouped_w4a16_into(torch.zeros(3, 256, dtype=torch.bfloat16, device=kernel_device), weight, offsets,
                                 torch.empty(3, 40, dtype=torch.bfloat16, device=kernel_device),
                                 {"BLOCK_N": 32, "BLOCK_K": 64}, x_mma_order=True)
