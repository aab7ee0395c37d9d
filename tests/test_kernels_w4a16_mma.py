"""The experimental Gluon decode W4A16 kernel (register-operand mma.sync) against the fp64 oracle.

Same checks as the Triton kernel's (tests/test_kernels_w4a16.py): bit for bit on inputs whose fp32
sums are exact, within the fp32 accumulation bound on realistic and raw weights; outputs and the
split-K workspace poisoned with NaN; counters restored. Gluon kernels do not run under the
interpreter, so everything but the argument checks needs the GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from test_kernels_w4a16 import (
    _activations,
    _assert_within,
    _exact_expected,
    _gaussian_weight,
    _grid_activations,
    _grouped_oracle,
    _oracle,
    _raw_weight,
    _same_bits,
    _tolerance,
    _with_ws2,
    assert_grouped_exact,
    poisoned_partials,  # noqa: F401 (a fixture: NaN in the split-K workspace both kernels share)
)

from megatron_quads.kernels import w4a16, w4a16_mma
from megatron_quads.rollout.grouped import expert_offsets_from_counts

CONFIGS = [
    w4a16_mma.DEFAULT_CONFIG,  # token tile from M (8, 16 or 32)
    {"BLOCK_M": 8, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 1, "PREFETCH": 2},
    {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 256, "SPLIT_K": 3, "num_warps": 4, "PREFETCH": 1},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 8, "num_warps": 1, "PREFETCH": 2},
    # weights through a shared-memory ring: fewer K steps per split than stages (copies past the
    # slice read nothing), splits past the last step, the fewest stages, 4 warps at BLOCK_K 64
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 3, "num_warps": 2, "PREFETCH": 1, "STAGES": 6},
    {"BLOCK_M": 8, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 1, "PREFETCH": 1, "STAGES": 2},
    {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 8, "num_warps": 4, "PREFETCH": 1, "STAGES": 4},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 2, "num_warps": 1, "PREFETCH": 1, "STAGES": 3},
    {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 5, "num_warps": 1, "PREFETCH": 1, "STAGES": 4,
     "maxnreg": 255},  # 128 weight rows a warp (spills without the ring)
    # x copied into shared memory once a program: slices not a power of 2 of steps (masked copies)
    # and splits past the last step, several warps sharing the slice, BLOCK_K 64 and 256
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 3, "num_warps": 1, "PREFETCH": 1, "X_SMEM": 1},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 5, "num_warps": 1, "PREFETCH": 2, "X_SMEM": 1,
     "maxnreg": 255},
    {"BLOCK_M": 32, "BLOCK_N": 256, "BLOCK_K": 128, "SPLIT_K": 8, "num_warps": 4, "PREFETCH": 1, "X_SMEM": 1},
    {"BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 2, "PREFETCH": 2, "X_SMEM": 1},
    {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 2, "PREFETCH": 1, "X_SMEM": 1},
]
SHAPES = [(1, 40, 512), (3, 72, 256), (16, 200, 1024), (17, 24, 512), (64, 4096 + 40, 2048), (16, 2048, 4096)]
"""(M, N, K): 1..64 tokens (several token tiles at 17 and 64), N not a multiple of the tile; K a
multiple of every BLOCK_K above (the kernel's requirement)."""


def _config_id(config: dict[str, int]) -> str:
    return "-".join(f"{k[0]}{k[-1]}{v}" for k, v in config.items())


def run_into(linear_into: Callable, x: torch.Tensor, weight, config: dict[str, int]) -> torch.Tensor:
    """``linear_into(x, weight, out, config)`` into a NaN-filled ``out``; the split-K counters must be back at 0."""
    out = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    assert linear_into(x, weight, out, config) is out
    assert all(int(c.abs().sum()) == 0 for c in w4a16._COUNTERS.values()), "split-K counters were not reset"
    return out


def check_exact(run: Callable[[torch.Tensor, object], torch.Tensor], device: str) -> None:
    """``run(x, weight)`` bit for bit on every shape of :data:`SHAPES`, inputs whose fp32 sums are exact."""
    for m, n, k in SHAPES:
        for decode in (None, 2.0**-7):
            weight = _raw_weight((n, k), device, scale_bytes=(0x28, 0x4F), decode=decode)
            x = _grid_activations((m, k), torch.bfloat16, device, bound=8 if k <= 256 else 1)
            assert _same_bits(run(x, weight), _exact_expected(x, weight, torch.bfloat16)), (m, n, k, decode)


def check_within_fp32_bound(run: Callable[[torch.Tensor, object], torch.Tensor], device: str) -> None:
    """``run(x, weight)`` within the fp32 accumulation bound on every shape, realistic and raw weights."""
    for m, n, k in SHAPES:
        for weight in (_gaussian_weight((n, k), device), _raw_weight((n, k), device)):
            x = _activations((m, k), torch.bfloat16, device)
            exact, magnitude = _oracle(x, weight)
            _assert_within(run(x, weight), exact, _tolerance(exact, magnitude, k, torch.bfloat16))


def _run(x: torch.Tensor, weight, config: dict[str, int]) -> torch.Tensor:
    return run_into(w4a16_mma.w4a16_mma_linear_into, x, weight, config)


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_partials")
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_exact_on_exactly_summable_inputs(kernel_device: str, config: dict[str, int]) -> None:
    check_exact(lambda x, weight: _run(x, weight, config), kernel_device)


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_partials")
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_within_fp32_accumulation_error(kernel_device: str, config: dict[str, int]) -> None:
    check_within_fp32_bound(lambda x, weight: _run(x, weight, config), kernel_device)


@pytest.mark.gpu
def test_agrees_with_the_triton_kernel_and_strided_rows(kernel_device: str) -> None:
    weight = _gaussian_weight((1024, 2048), kernel_device)
    x = _activations((24, 4096), torch.bfloat16, kernel_device)[:, ::2]  # row stride 4096, column stride 2
    y = _run(x, weight, w4a16_mma.DEFAULT_CONFIG)
    reference = w4a16.w4a16_linear_kernel(x.contiguous(), weight)
    assert torch.allclose(y.float(), reference.float(), rtol=2**-7, atol=1e-3 * float(reference.float().abs().max()))


GROUPED_CONFIGS = [
    {},  # defaults, token tile from the mean rows per expert
    {"BLOCK_M": 8, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 1, "PREFETCH": 2},
    {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 4, "PREFETCH": 1},
    # the ring reused across an expert's token tiles
    {"BLOCK_M": 8, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 1, "PREFETCH": 1, "STAGES": 4},
    {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "PREFETCH": 1, "STAGES": 3},
]


def grouped_cases(big_expert_rows: int = 70) -> list[tuple[list[int], int, int]]:
    """(tokens per expert, N, K): empty experts, one expert with everything (``big_expert_rows``:
    several token tiles), E = 1, N not a multiple of the tile, and Qwen3-30B-A3B gate/up routing of
    512 tokens (top-8 of 128 experts, skewed)."""
    routed = torch.distributions.Categorical(logits=torch.randn(128) * 1.5).sample((512 * 8,))
    return [([3, 0, 17, 5], 40, 256), ([0, 0, big_expert_rows, 0], 24, 512), ([7], 72, 256),
            (torch.bincount(routed, minlength=128).tolist(), 1536, 2048), ([0] * 15 + [200], 768 + 40, 2048)]


def check_grouped_exact(run: Callable[[torch.Tensor, object, list[int]], torch.Tensor],
                        cases: list[tuple[list[int], int, int]], device: str) -> None:
    """``run(x, weight, counts)`` bit for bit on every case, inputs whose fp32 sums are exact."""
    for counts, n, k in cases:
        weight = _raw_weight((len(counts), n, k), device, scale_bytes=(0x28, 0x4F))
        x = _grid_activations((sum(counts), k), torch.bfloat16, device, bound=1)
        assert_grouped_exact(run(x, weight, counts), x, weight, counts)


def check_grouped_within_fp32_bound(run: Callable[[torch.Tensor, object, list[int]], torch.Tensor],
                                    cases: list[tuple[list[int], int, int]], device: str, ws2_layout: str) -> None:
    """``run(x, weight, counts)`` within the fp32 accumulation bound on every case, Gaussian and raw
    weights with ``weight_scale_2`` laid out as ``ws2_layout``."""
    for counts, n, k in cases:
        for weight in (_gaussian_weight((len(counts), n, k), device), _raw_weight((len(counts), n, k), device)):
            weight = _with_ws2(weight, ws2_layout)
            x = _activations((sum(counts), k), torch.bfloat16, device)
            exact, magnitude = _grouped_oracle(x, weight, counts)
            _assert_within(run(x, weight, counts), exact, _tolerance(exact, magnitude, k, torch.bfloat16))


def _grouped_run(x: torch.Tensor, weight, counts: list[int], config: dict[str, int]) -> torch.Tensor:
    offsets = expert_offsets_from_counts(torch.tensor(counts)).to(x.device)
    out = torch.full((x.shape[0], weight.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    assert w4a16_mma.grouped_w4a16_mma_into(x, weight, offsets, out, config) is out
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("config", GROUPED_CONFIGS, ids=lambda c: _config_id(c) or "default")
def test_grouped_exact_on_exactly_summable_inputs(kernel_device: str, config: dict[str, int]) -> None:
    check_grouped_exact(lambda x, weight, counts: _grouped_run(x, weight, counts, config), grouped_cases(),
                        kernel_device)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GROUPED_CONFIGS, ids=lambda c: _config_id(c) or "default")
@pytest.mark.parametrize("ws2_layout", ["E1", "shared"])
def test_grouped_within_fp32_accumulation_error(kernel_device: str, config: dict[str, int], ws2_layout: str) -> None:
    check_grouped_within_fp32_bound(lambda x, weight, counts: _grouped_run(x, weight, counts, config), grouped_cases(),
                                    kernel_device, ws2_layout)


def test_argument_errors() -> None:
    weight = _raw_weight((32, 128), "cpu")
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    out = torch.empty(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K % BLOCK_K == 0"):
        w4a16_mma.w4a16_mma_linear_into(x, weight, out, {"BLOCK_K": 256})
    with pytest.raises(ValueError, match="BLOCK_N % \\(16 \\* num_warps\\)"):
        w4a16_mma.w4a16_mma_linear_into(x, weight, out, {"BLOCK_N": 32, "num_warps": 4})
    with pytest.raises(ValueError, match="PREFETCH"):
        w4a16_mma.w4a16_mma_linear_into(x, weight, out, {"PREFETCH": 3})
    with pytest.raises(ValueError, match="STAGES must be 0"):
        w4a16_mma.w4a16_mma_linear_into(x, weight, out, {"STAGES": 1})
    with pytest.raises(ValueError, match="scale copy"):
        w4a16_mma.w4a16_mma_linear_into(x, weight, out, {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 2, "STAGES": 3})
    with pytest.raises(ValueError, match="X_SMEM must be 0 or 1"):
        w4a16_mma.w4a16_mma_linear_into(x, weight, out, {"X_SMEM": 1, "STAGES": 2})
    with pytest.raises(ValueError, match="X_SMEM must be 0 or 1"):
        w4a16_mma.w4a16_mma_linear_into(x, weight, out, {"X_SMEM": 2})
    long_x = torch.zeros(32, 4096, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="raise SPLIT_K or lower BLOCK_M"):  # 32 steps x 128 x 32 tokens x 2 B
        w4a16_mma.w4a16_mma_linear_into(long_x, _raw_weight((32, 4096), "cpu"), torch.empty(32, 32, dtype=torch.bfloat16),
                                        {"X_SMEM": 1, "SPLIT_K": 1, "BLOCK_M": 32})
    with pytest.raises(ValueError, match="BLOCK_M 8, 16 or 32"):
        w4a16_mma.w4a16_mma_linear_into(x, weight, out, {"BLOCK_M": 64})
    with pytest.raises(ValueError, match="x must be"):
        w4a16_mma.w4a16_mma_linear_into(x.unsqueeze(0), weight, out)
    with pytest.raises(TypeError, match="bfloat16 activations"):
        w4a16_mma.w4a16_mma_linear_into(x.float(), weight, out)
    with pytest.raises(ValueError, match="out must be"):
        w4a16_mma.w4a16_mma_linear_into(x, weight, out[:, :16])
    stacked = _raw_weight((3, 32, 128), "cpu")
    offsets = expert_offsets_from_counts(torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="stacked"):
        w4a16_mma.grouped_w4a16_mma_into(x, weight, offsets, out)
    with pytest.raises(ValueError, match="expert_offsets must be int32"):
        w4a16_mma.grouped_w4a16_mma_into(x, stacked, offsets.long(), out)
    with pytest.raises(ValueError, match="K % BLOCK_K == 0"):
        w4a16_mma.grouped_w4a16_mma_into(x, stacked, offsets, out, {"BLOCK_K": 256})
    with pytest.raises(ValueError, match="dense kernel only"):
        w4a16_mma.grouped_w4a16_mma_into(x, stacked, offsets, out, {"X_SMEM": 1})


def test_launch_grid_and_options_follow_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host side on CPU (the kernels themselves need the GPU): grid, default token tile from M
    (grouped: from twice the mean rows per expert), ``maxnreg`` passed to the launch."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs))

    monkeypatch.setattr(w4a16_mma, "_decode_kernel", Recorder())
    monkeypatch.setattr(w4a16_mma, "_grouped_decode_kernel", Recorder())
    x = torch.zeros(20, 256, dtype=torch.bfloat16)
    out = torch.empty(20, 96, dtype=torch.bfloat16)
    dense_config = {"BLOCK_N": 32, "num_warps": 1, "maxnreg": 255, "STAGES": 5}
    w4a16_mma.w4a16_mma_linear_into(x, _raw_weight((96, 256), "cpu"), out, dense_config)
    offsets = expert_offsets_from_counts(torch.tensor([5, 15, 0, 0]))
    w4a16_mma.grouped_w4a16_mma_into(x, _raw_weight((4, 96, 256), "cpu"), offsets, out)
    w4a16_mma.w4a16_mma_linear_into(torch.zeros(20, 768, dtype=torch.bfloat16), _raw_weight((96, 768), "cpu"), out,
                                    {"X_SMEM": 1, "SPLIT_K": 1})
    (dense_grid, dense), (grouped_grid, grouped), (_, x_slice) = launches
    assert dense_grid == (3, 4, 1) and dense["BLOCK_M"] == 32 and dense["maxnreg"] == 255 and dense["num_warps"] == 1
    assert dense["STAGES"] == 5 and grouped["STAGES"] == 0 and dense["X_STEPS"] == 0
    assert x_slice["X_STEPS"] == 8  # 6 K steps of 128, rounded up to a power of 2
    assert grouped_grid == (2, 4) and grouped["BLOCK_M"] == 16 and "maxnreg" not in grouped and grouped["num_warps"] == 2
