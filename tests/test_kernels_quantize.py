"""The Triton NVFP4 quantize / fake-quant kernels are byte-identical to the PyTorch reference.

Every kernel output is written into a poisoned buffer (0xFF bytes: NaN scales, NaN values), and the
reference always runs on CPU (the TE-exact path). Under ``TRITON_INTERPRET=1`` the shapes are small.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl
from test_nvfp4_golden import CASES, TENSORS

import megatron_quads.nvfp4.quantize_kernel as kq
from megatron_quads.nvfp4.format import round_to_e2m1_codes
from megatron_quads.nvfp4.fused import fake_quant_values
from megatron_quads.nvfp4.quantize_kernel import (
    amax_kernel,
    fake_quant_kernel,
    quantize_kernel,
    row_amax_quantize_kernel,
)
from megatron_quads.nvfp4.quantize import quantize
from megatron_quads.nvfp4.tensor import NVFP4Tensor
from megatron_quads.nvfp4.triton_codec import e2m1_code, e4m3_round, e4m3_to_f32

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# numpy division by zero (amax 0, scale 0) is expected in the interpreter, as inf on the GPU
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


# ----------------------------------------------------------------------------------------- helpers


def _big(device: str) -> bool:
    return device == "cuda"


def _same_f32(got: torch.Tensor | None, ref: torch.Tensor | None) -> bool:
    if got is None or ref is None:
        return got is ref
    return (got.shape == ref.shape and got.dtype == ref.dtype == torch.float32
            and torch.equal(got.cpu().reshape(-1).view(torch.int32), ref.reshape(-1).view(torch.int32)))


def _same_bits(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(got.cpu().view(torch.uint8), ref.view(torch.uint8))


def _assert_same(got: NVFP4Tensor, ref: NVFP4Tensor) -> None:
    assert (got.shape, got.dtype, got.block_2d) == (ref.shape, ref.dtype, ref.block_2d)
    assert got.codes.dtype == torch.uint8 and got.scales.dtype == torch.float8_e4m3fn
    n_codes = int((got.codes.cpu() != ref.codes).sum()) if got.codes.shape == ref.codes.shape else -1
    assert got.codes.shape == ref.codes.shape and n_codes == 0, f"{n_codes} code bytes differ"
    got_s, ref_s = got.scales.cpu().view(torch.uint8), ref.scales.view(torch.uint8)
    n_scales = int((got_s != ref_s).sum()) if got_s.shape == ref_s.shape else -1
    assert got_s.shape == ref_s.shape and n_scales == 0, f"{n_scales} scale bytes differ"
    assert _same_f32(got.weight_scale_2, ref.weight_scale_2)
    assert _same_f32(got.global_amax, ref.global_amax)


def _cpu_amax(amax: object) -> object:
    return amax.cpu() if isinstance(amax, torch.Tensor) else amax


def _poisoned_codes(shape: tuple[int, ...], device: torch.device, offset: int = 0) -> torch.Tensor:
    """0xFF-filled uint8 codes; ``offset`` bytes into a larger buffer (the kernels store 8-byte words)."""
    n = math.prod(shape)
    return torch.full((n + offset,), 0xFF, dtype=torch.uint8, device=device)[offset:].view(shape)


def _check_quantize(x: torch.Tensor, amax: object = None, block_2d: bool = False, codes_offset: int = 0) -> NVFP4Tensor:
    """quantize_kernel into 0xFF-poisoned buffers equals the CPU reference, field for field."""
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    codes = _poisoned_codes(lead + (k // 2,), x.device, codes_offset)
    scales = torch.full(lead + (k // 16,), 0xFF, dtype=torch.uint8, device=x.device)
    got = quantize_kernel(x, global_amax=amax, block_2d=block_2d, out=(codes, scales))
    assert got.codes.data_ptr() == codes.data_ptr() and got.scales.data_ptr() == scales.data_ptr()
    ref = quantize(x.cpu(), global_amax=_cpu_amax(amax), block_2d=block_2d)
    _assert_same(got, ref)
    return ref


def _check_fake_quant(x: torch.Tensor, amax: torch.Tensor, out: torch.Tensor | None = None) -> None:
    if out is None:
        out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
    out.fill_(float("nan"))
    got = fake_quant_kernel(x, amax, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = fake_quant_values(x.cpu(), amax.cpu()).contiguous()
    n = int((got.cpu().view(torch.uint8) != ref.view(torch.uint8)).sum())
    assert _same_bits(got, ref), f"{n} bytes differ"


def _check_row_amax(x: torch.Tensor, codes_offset: int = 0) -> None:
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    out = (
        _poisoned_codes(lead + (k // 2,), x.device, codes_offset),
        torch.full(lead + (k // 16,), 0xFF, dtype=torch.uint8, device=x.device),
        torch.full(lead, float("nan"), device=x.device),
        torch.full(lead, float("nan"), device=x.device),
    )
    got = row_amax_quantize_kernel(x, out=out)
    assert got.global_amax.data_ptr() == out[2].data_ptr() and got.weight_scale_2.data_ptr() == out[3].data_ptr()
    xc = x.cpu()
    _assert_same(got, quantize(xc, global_amax=xc.abs().amax(-1).float()))


def _randn(shape: tuple[int, ...], scale: float, dtype: torch.dtype, device: str) -> torch.Tensor:
    x = torch.randn(shape) * scale
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype).to(device)


def _ties_tensor(rows: int, blocks: int, log2_enc: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocks whose scaled values hit E2M1 ties exactly when ``S_enc = 2^log2_enc``.

    Each block has a power-of-two e4m3 scale ``s``: its amax is ``6 s / S_enc`` (so the fp32 scale
    rounds to exactly ``s``) and the other elements are ``+-t s / S_enc`` for ties ``t`` (and, in fp32,
    their neighbours one ulp away), which the element encode ``S_enc / s`` maps exactly onto ``t``.
    """
    s = torch.exp2(torch.randint(-9, 9, (rows, blocks, 1)).float() - log2_enc)
    t = torch.tensor(TIES)[torch.randint(0, len(TIES), (rows, blocks, 16))]
    if dtype == torch.float32:
        nudge = torch.randint(-1, 2, t.shape)  # -1, 0, +1 ulp
        t = torch.where(nudge > 0, torch.nextafter(t, torch.tensor(9.0)), t)
        t = torch.where(nudge < 0, torch.nextafter(t, torch.tensor(0.0)), t)
    t[..., 0] = 6.0
    t = t[..., torch.randperm(16)]
    sign = torch.where(torch.rand(t.shape) < 0.5, -1.0, 1.0)
    x = (sign * t * s).reshape(rows, blocks * 16)
    assert (x.to(dtype).float() == x).float().mean() > 0.9  # the dtype holds the tie inputs exactly
    return x.to(dtype)


def _e4m3_midpoint_tensor(global_amax: float) -> torch.Tensor:
    """fp32 blocks whose pre-cast scale ``block_amax * (S_enc * fp32(1/6))`` is exactly an e4m3 midpoint."""
    byte_values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    midpoints = (byte_values[:-1] + byte_values[1:]) / 2  # exact in fp32
    amax = torch.tensor(global_amax)
    enc = torch.clamp(torch.div(torch.tensor(2688.0), amax), max=torch.finfo(torch.float32).max)
    mult = enc * torch.reciprocal(torch.tensor(6.0))
    rows = []
    for m in midpoints:
        c = torch.div(m, mult)
        for _ in range(6):  # walk a few ulps to where the fp32 product lands exactly on m
            p = c * mult
            if p == m:
                break
            c = torch.nextafter(c, torch.tensor(float("inf")) if p < m else torch.tensor(0.0))
        if c * mult == m:
            row = torch.rand(16) * c
            row[torch.randint(0, 16, ())] = c * (1 if torch.rand(()) < 0.5 else -1)
            rows.append(row)
    assert len(rows) > 100, "too few exact e4m3 midpoints found"
    return torch.stack(rows[: len(rows) // 4 * 4]).reshape(-1, 64)


# ----------------------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_random_normal_over_scales_and_shapes(dtype: torch.dtype, kernel_device: str) -> None:
    shapes = [(257, 1024), (4, 100, 512), (3, 5, 2048)] if _big(kernel_device) else [(5, 48), (2, 3, 64), (33, 80)]
    for shape in shapes:
        for scale in (1e-6, 1e-3, 1.0, 1e2, 1e4):
            _check_quantize(_randn(shape, scale, dtype, kernel_device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_amax_modes(dtype: torch.dtype, kernel_device: str) -> None:
    e, n, k = (8, 200, 512) if _big(kernel_device) else (3, 20, 48)
    x = _randn((e, n, k), 1.0, dtype, kernel_device)
    true_amax = float(x.abs().amax())
    row_amax = x.abs().amax(-1).float()
    factors = torch.rand(e, n, device=kernel_device) * 3.75 + 0.25
    amaxes = [
        None,
        true_amax * 1.7,
        torch.tensor(true_amax * 0.6, device=kernel_device),  # below the true max: saturation
        row_amax * factors,  # one per row
        row_amax.amax(-1, keepdim=True) * factors[:, :1],  # [E, 1]: one per expert
        row_amax.amax(0) * 1.3,  # [N]: broadcast over experts (materialized table)
        (row_amax * factors).t().contiguous().t(),  # per row, non-contiguous
        torch.tensor([[2.0 * true_amax]], device=kernel_device),  # [1, 1]
    ]
    for amax in amaxes:
        _check_quantize(x, amax)
    _check_quantize(x.transpose(0, 1))  # non-contiguous input
    _check_quantize(x[0, 0], torch.tensor(true_amax, device=kernel_device))  # 1D input


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_2d_blocks(dtype: torch.dtype, kernel_device: str) -> None:
    """16x16 tiles with one amax and per-matrix amax (each tile's scale computed once: its rows share
    their amax) and with per-row amax (scaled row by row): the reference bytes."""
    big = _big(kernel_device)
    shapes = [(1000, 512), (4, 129, 256), (2, 3, 40, 128)] if big else [(20, 64), (3, 21, 48), (2, 2, 16, 32), (1, 32), (7, 16)]
    for shape in shapes:
        x = _randn(shape, 1.0, dtype, kernel_device)
        x[..., :5, :16] *= 50  # an outlier tile
        _check_quantize(x, block_2d=True)
        _check_quantize(x, x.abs().amax(-1).float() * 1.5, block_2d=True)  # per-row amax
        if x.ndim == 3:
            _check_quantize(x, x.abs().amax(dim=(1, 2)).float()[:, None] * 0.5, block_2d=True)  # [E, 1], saturating


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_quantize_golden_te_cases(case: dict, kernel_device: str) -> None:
    x = TENSORS[f"{case['name']}.x"].to(kernel_device)
    ref = _check_quantize(x, block_2d=case["block"] == "16x16")
    golden = ref.scales.view(torch.uint8)[::16] if ref.block_2d else ref.scales.view(torch.uint8)
    assert torch.equal(golden, TENSORS[f"{case['name']}.scales"])  # the reference is still TE's


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_exact_e2m1_ties(dtype: torch.dtype, kernel_device: str) -> None:
    rows, blocks = (512, 32) if _big(kernel_device) else (6, 4)
    for log2_enc in (0, 10, -4):
        x = _ties_tensor(rows, blocks, log2_enc, dtype).to(kernel_device)
        _check_quantize(x, 2688.0 * 2.0**-log2_enc)


def test_e2m1_rounding_sweep(kernel_device: str) -> None:
    """With amax 2688 and a 6 in every block, scale and element encode are 1: codes are e2m1(x)."""
    ties = torch.tensor((*TIES, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))
    near = [ties]
    for direction in (0.0, 100.0):
        t = ties
        for _ in range(3):
            t = torch.nextafter(t, torch.tensor(direction))
            near.append(t)
    n_grid = 60000 if _big(kernel_device) else 3000
    values = torch.cat([*near, torch.linspace(0, 7.5, n_grid), torch.tensor([6.5, 7.0, 1e3, 1e30, 3e38, 1e-30, 1e-45])])
    values = values * torch.where(torch.rand(values.shape) < 0.5, -1.0, 1.0)
    values = torch.cat([values, torch.zeros(-values.numel() % 60)]).reshape(-1, 15)  # 4 blocks per row
    x = torch.cat([torch.full((values.shape[0], 1), 6.0), values], dim=1).reshape(-1, 64)
    _check_quantize(x.to(kernel_device), 2688.0)
    _check_fake_quant(x.to(kernel_device), torch.tensor(2688.0, device=kernel_device))


def test_quantize_exact_e4m3_midpoints(kernel_device: str) -> None:
    for global_amax in (2688.0, 1000.0, 7.0, 123.456):
        x = _e4m3_midpoint_tensor(global_amax).to(kernel_device)
        _check_quantize(x, global_amax)
        _check_fake_quant(x, torch.tensor(global_amax, device=kernel_device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_zeros_and_signed_zeros(dtype: torch.dtype, kernel_device: str) -> None:
    m, k = (64, 256) if _big(kernel_device) else (4, 48)
    zeros = torch.zeros(m, k, dtype=dtype)
    zeros[::2, 3::5] = -0.0
    _check_quantize(zeros.to(kernel_device))  # amax 0: S_enc = FLT_MAX
    _check_quantize(zeros.to(kernel_device), 0.0)
    _check_quantize(zeros.to(kernel_device), 5.0)
    x = _randn((m, k), 1.0, dtype, "cpu")
    x[0, :16] = 0.0  # a zero block
    x[1, 16:32] = -0.0  # a -0.0 block
    x[2, :] = torch.where(torch.rand(k) < 0.5, -0.0, 1e-3)  # -0.0 next to small values
    x[3, 32:48] = -torch.rand(16) * 1e-2  # negatives that round to -0 (code 8) at this amax
    x[3, 32] = -6.0
    _check_quantize(x.to(kernel_device))
    _check_quantize(x.to(kernel_device), 6.0 * 448)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_outliers_saturation_and_tiny_scales(dtype: torch.dtype, kernel_device: str) -> None:
    m, k = (128, 1024) if _big(kernel_device) else (6, 64)
    x = _randn((m, k), 1.0, dtype, "cpu")
    cols = torch.randint(0, k, (m,))
    x[torch.arange(m), cols] = (torch.rand(m) * 3e4 + 10).to(dtype) * torch.where(torch.rand(m) < 0.5, -1, 1).to(dtype)
    x = x.to(kernel_device)
    true_amax = float(x.abs().amax())
    _check_quantize(x)  # outliers next to normal blocks: small scales, some subnormal
    _check_quantize(x, true_amax * 0.05)  # amax below the true max: scales clamp at 448, codes at 6
    _check_quantize(x, true_amax * 1e3)  # a huge amax: e4m3-subnormal and zero scales
    tiny = _randn((m, k), 1.0, dtype, "cpu") * torch.logspace(0, -7, k // 16).repeat_interleave(16).to(dtype)
    _check_quantize(tiny.to(kernel_device), 1e4)  # zero-scale blocks with non-zero data (encode = FLT_MAX)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_subnormal_inputs_and_infinite_encode_scale(dtype: torch.dtype, kernel_device: str) -> None:
    """fp32 / bf16 subnormal inputs: 2688 / amax overflows to FLT_MAX (catches flush-to-zero too)."""
    m, k = (64, 512) if _big(kernel_device) else (4, 64)
    for scale in (1e-40, 1e-38, 1e-30):
        x = (torch.randn(m, k) * scale).to(dtype).to(kernel_device)
        _check_quantize(x)
        _check_quantize(x, x.abs().amax(-1).float())
        _check_fake_quant(x, x.abs().amax().float())
        _check_row_amax(x)
    x = (torch.randn(m, k) * 1e30).to(dtype).to(kernel_device)
    _check_quantize(x, 3e38)  # S_enc ~ 1e-35: element encodes near FLT_MAX


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_storage_offsets_and_strided_inputs(dtype: torch.dtype, kernel_device: str) -> None:
    """Kernels read and write pairs of elements as words: inputs / outputs that start mid-word."""
    m, k = (96, 512) if _big(kernel_device) else (5, 48)
    flat = _randn((m * k + 1,), 1.0, dtype, kernel_device)
    x = flat[1:].view(m, k)  # contiguous, odd storage offset
    assert x.is_contiguous() and x.storage_offset() == 1
    _check_quantize(x)
    _check_quantize(x, x.abs().amax(-1).float())
    _check_row_amax(x)
    out = torch.empty(m * k + 1, dtype=dtype, device=kernel_device)[1:].view(m, k)
    _check_fake_quant(x, x.abs().amax().float(), out=out)
    xt = _randn((k, m + 3), 1.0, dtype, kernel_device)[:, 1:-2].t()  # strided
    _check_fake_quant(xt, xt.abs().amax(-1).float())
    _check_quantize(xt, block_2d=True)


@pytest.mark.parametrize("codes_offset", [1, 4])
def test_code_buffers_not_8_byte_aligned(codes_offset: int, kernel_device: str) -> None:
    """``out`` codes inside a larger buffer: the kernels store 8-byte words, so a misaligned buffer is
    written through an aligned one, with the same bytes and nothing outside it touched."""
    m, k = (64, 256) if _big(kernel_device) else (6, 64)
    x = _randn((m, k), 1.0, torch.bfloat16, kernel_device)
    _check_quantize(x, codes_offset=codes_offset)
    _check_row_amax(x, codes_offset=codes_offset)
    lead = torch.full((m * k // 2 + codes_offset,), 0xFF, dtype=torch.uint8, device=kernel_device)
    quantize_kernel(x, out=(lead[codes_offset:].view(m, k // 2), torch.empty(m, k // 16, dtype=torch.uint8, device=kernel_device)))
    assert bool((lead[:codes_offset] == 0xFF).all())


def test_quantize_empty_and_errors(kernel_device: str) -> None:
    _check_quantize(torch.zeros(0, 32, device=kernel_device))
    _check_quantize(torch.zeros(2, 0, 32, device=kernel_device), block_2d=True)
    bad = [
        (torch.ones(4, 32, device=kernel_device, dtype=torch.int32), {}),
        (torch.ones(4, 40, device=kernel_device), {}),
        (torch.ones(32, device=kernel_device), {"block_2d": True}),
        (torch.tensor([[float("nan")] * 16], device=kernel_device), {}),
        (torch.ones(4, 32, device=kernel_device), {"global_amax": -1.0}),
        (torch.ones(4, 32, device=kernel_device), {"global_amax": torch.ones(3, device=kernel_device)}),
    ]
    for x, kwargs in bad:
        with pytest.raises((TypeError, ValueError)) as ref_err:
            quantize(x.cpu(), **{k: _cpu_amax(v) for k, v in kwargs.items()})
        with pytest.raises(ref_err.type) as got_err:
            quantize_kernel(x, **kwargs)
        assert str(got_err.value).split("tensor(")[0] == str(ref_err.value).split("tensor(")[0]


def test_quantize_without_validation(kernel_device: str) -> None:
    """``validate=False`` (no host sync) gives the same bytes, and still rejects bad shapes / dtypes."""
    x = _randn((40, 96), 1.0, torch.bfloat16, kernel_device)
    for amax, block_2d in ((None, False), (x.abs().amax(-1).float(), False), (3.0, True)):
        got = quantize_kernel(x, global_amax=amax, block_2d=block_2d, validate=False)
        _assert_same(got, quantize(x.cpu(), global_amax=_cpu_amax(amax), block_2d=block_2d))
    for bad, block_2d in ((torch.ones(4, 40, device=kernel_device), False), (torch.ones(32, device=kernel_device), True)):
        with pytest.raises(ValueError):
            quantize_kernel(bad, block_2d=block_2d, validate=False)


def test_amax_kernel_matches_torch(kernel_device: str) -> None:
    # more 4096-element blocks than programs (4 per SM; 4 programs under the interpreter), a partial one
    sizes = [(3, 2**20 + 48), (1, 16)] if _big(kernel_device) else [(16, 4096 + 16), (1, 16)]
    for shape in sizes:
        for dtype in DTYPES:
            x = _randn(shape, 1.0, dtype, kernel_device)
            x.view(-1)[-1] = 50.0  # the max in the last, partial block
            got = amax_kernel(x)
            assert _same_f32(got, x.cpu().abs().amax().float())
            _check_quantize(x)
    assert float(amax_kernel(torch.zeros(0, 16, device=kernel_device))) == 0.0


# ----------------------------------------------------------------------------------------- fake quant


@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_quant_matches_reference_bits(dtype: torch.dtype, kernel_device: str) -> None:
    e, n, k = (8, 256, 1024) if _big(kernel_device) else (3, 10, 64)
    for scale in (1e-6, 1e-2, 1.0, 1e3):
        w = _randn((e, n, k), scale, dtype, kernel_device)
        w[0, 0, :16] = 0.0
        w[0, 1, :16] = -0.0
        row_amax = w.abs().amax(-1).float()
        _check_fake_quant(w, w.abs().amax().float())  # per tensor, 0-dim
        _check_fake_quant(w, row_amax.amax(-1, keepdim=True))  # per expert [E, 1]
        _check_fake_quant(w, row_amax * 1.5)  # per row, no saturation
        _check_fake_quant(w, row_amax.amax(-1, keepdim=True) * 0.3)  # saturating
        _check_fake_quant(w[1], torch.tensor(100.0 * scale, device=kernel_device))  # shared, larger amax


@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_quant_adversarial(dtype: torch.dtype, kernel_device: str) -> None:
    rows, blocks = (256, 16) if _big(kernel_device) else (4, 4)
    for log2_enc in (0, 10):
        x = _ties_tensor(rows, blocks, log2_enc, dtype).to(kernel_device)
        _check_fake_quant(x, torch.tensor(2688.0 * 2.0**-log2_enc, device=kernel_device))
    zeros = torch.zeros(rows, blocks * 16, dtype=dtype, device=kernel_device)
    zeros[1::2] = -0.0
    _check_fake_quant(zeros, zeros.float().abs().amax())
    tiny = _randn((rows, blocks * 16), 1.0, dtype, "cpu") * torch.logspace(0, -7, blocks).repeat_interleave(16).to(dtype)
    _check_fake_quant(tiny.to(kernel_device), torch.tensor(1e4, device=kernel_device))


@pytest.mark.parametrize("case", [c for c in CASES if c["block"] == "1x16"], ids=lambda c: c["name"])
def test_fake_quant_golden_inputs(case: dict, kernel_device: str) -> None:
    x = TENSORS[f"{case['name']}.x"]
    _check_fake_quant(x.to(kernel_device), x.abs().amax().float().to(kernel_device))


# ----------------------------------------------------------------------------------------- per-row dynamic


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_amax_quantize(dtype: torch.dtype, kernel_device: str) -> None:
    if _big(kernel_device):
        shapes = [(300, 4096), (64, 16384), (5, 20016), (1, 7168), (2, 17, 2048), (2100, 1040)]
    else:
        shapes = [(7, 48), (3, 2064), (2, 3, 32), (1, 16)]  # 2064: a second, partial pass of 128 blocks
    for shape in shapes:
        for scale in (1e-4, 1.0, 1e3):
            x = _randn(shape, scale, dtype, "cpu")
            x.view(-1, shape[-1])[0] = 0.0  # a zero row: amax 0
            if x.shape[0] > 1:
                x.view(-1, shape[-1])[1, -1] = 3e4 * scale if dtype != torch.float16 else 6e4  # an outlier
            _check_row_amax(x.to(kernel_device))
    _check_row_amax(torch.zeros(0, 32, dtype=dtype, device=kernel_device))


# ----------------------------------------------------------------------------------------- format device functions


@triton.jit
def _e4m3_round_probe(v_ptr, value_ptr, byte_ptr, decoded_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    v = tl.load(v_ptr + i, mask=i < n, other=0.0)
    byte, value = e4m3_round(v)
    tl.store(value_ptr + i, value, mask=i < n)
    tl.store(byte_ptr + i, byte, mask=i < n)
    tl.store(decoded_ptr + i, e4m3_to_f32(byte), mask=i < n)


@triton.jit
def _e2m1_probe(v_ptr, code_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    v = tl.load(v_ptr + i, mask=i < n, other=0.0)
    tl.store(code_ptr + i, e2m1_code(v), mask=i < n)


def _neighbours(v: torch.Tensor) -> torch.Tensor:
    up = torch.nextafter(v, torch.full_like(v, float("inf")))
    down = torch.nextafter(v, torch.full_like(v, float("-inf")))
    return torch.cat([v, up, down])


def test_e4m3_rounding_matches_torch_at_every_boundary(kernel_device: str) -> None:
    """:func:`triton_codec.e4m3_round` and :func:`e4m3_to_f32` against torch's float8_e4m3fn cast."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32: the round-half-even ties
    rand = torch.rand(3000, generator=torch.Generator().manual_seed(11)) * 10.0 ** (-4 * torch.rand(3000, generator=torch.Generator().manual_seed(12))) * 448
    v = torch.cat([_neighbours(grid), _neighbours(mids), rand]).clamp(0, 448)
    n = v.numel()
    value = torch.full((n,), float("nan"), device=kernel_device)
    byte = torch.full((n,), -1, dtype=torch.int32, device=kernel_device)
    decoded = torch.full((n,), float("nan"), device=kernel_device)
    _e4m3_round_probe[(1,)](v.to(kernel_device), value, byte, decoded, n, BLOCK=triton.next_power_of_2(n))
    expected = v.to(torch.float8_e4m3fn)
    assert torch.equal(byte.cpu(), expected.view(torch.uint8).to(torch.int32))
    assert torch.equal(value.cpu(), expected.float())
    assert torch.equal(decoded.cpu(), expected.float())


def test_e2m1_codes_match_the_reference_thresholds(kernel_device: str) -> None:
    """:func:`triton_codec.e2m1_code` against the reference's thresholds (ties, saturation, -0.0)."""
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 1e30])
    v = _neighbours(torch.cat([points, -points, torch.tensor([-0.0])]))
    v = torch.cat([v, torch.randn(500, generator=torch.Generator().manual_seed(13)) * 4])
    code = torch.full((v.numel(),), -1, dtype=torch.int32, device=kernel_device)
    _e2m1_probe[(1,)](v.to(kernel_device), code, v.numel(), BLOCK=triton.next_power_of_2(v.numel()))
    assert torch.equal(code.cpu(), round_to_e2m1_codes(v).to(torch.int32))


# ----------------------------------------------------------------------------------------- every config


@pytest.mark.parametrize("fast_max_rows", [0, 64], ids=["triton stores", "direct stores"])
@pytest.mark.parametrize("config", kq._TILE_CONFIGS, ids=str)
def test_every_tile_config(config: tuple[int, int, int], fast_max_rows: int, kernel_device: str,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each autotune candidate (a different tiling and thread layout) is exact, 2D scaling included,
    with Triton's code arithmetic and stores and with the PTX codes and direct stores (GPU only)."""
    monkeypatch.setattr(kq, "_tile_config", lambda rows, block_2d, blocks: config)
    monkeypatch.setattr(kq, "_fast_max_rows", lambda: fast_max_rows)
    m, k = (200, 2064) if _big(kernel_device) else (37, 2064)  # partial tiles in both directions
    x = _randn((m, k), 1.0, torch.bfloat16, kernel_device)
    x[3, 100] = 300.0
    _check_quantize(x)
    _check_quantize(x, x.abs().amax(-1).float() * 0.7)
    _check_fake_quant(x, x.abs().amax(-1).float())
    if config[0] % 16 == 0:
        _check_quantize(x[: m // 2 * 2].reshape(2, m // 2, k), block_2d=True)  # matrices of 100 / 18 rows


@pytest.mark.parametrize("config", kq._ROW_CONFIGS, ids=str)
def test_every_row_config(config: tuple[int, int, int], kernel_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kq, "_row_config", lambda rows: config)
    m, k = (300, 16400) if _big(kernel_device) else (9, 2064)
    _check_row_amax(_randn((m, k), 1.0, torch.bfloat16, kernel_device))


@pytest.mark.parametrize("stages", [1, 3])
def test_persistent_programs_loop_over_tiles(stages: int, kernel_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One program per SM and K tile walks many row tiles (then matrices of a stack), loading the
    next tile ahead (fake quant: 1 or 3 async-copy stages); every tile, partial and per-row amax
    included, stays exact."""
    monkeypatch.setattr(kq, "_loop_config", lambda block_2d=False: 1)
    monkeypatch.setattr(kq, "_FAKE_QUANT_LOOP", (1, stages))
    x = _randn((3, 40, 2064), 1.0, torch.bfloat16, kernel_device)  # partial K and row tiles in every matrix
    x[1, 7, 5] = -250.0
    _check_quantize(x)
    _check_quantize(x, x.abs().amax(-1).float() * 0.9)
    _check_quantize(x, x.abs().amax(dim=(1, 2)).unsqueeze(1).float())  # one amax per matrix
    _check_quantize(x, block_2d=True)
    _check_fake_quant(x, x.abs().amax(-1).float())
    _check_fake_quant(x, x.abs().amax().float())
