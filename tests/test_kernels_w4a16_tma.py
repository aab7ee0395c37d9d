"""The experimental TMA-ring Gluon decode W4A16 kernel against the fp64 oracle.

The checks of tests/test_kernels_w4a16_mma.py (bit for bit on exactly summable inputs, within the
fp32 accumulation bound otherwise, outputs and split-K workspace poisoned, counters restored) on
its own configs; the host side (config errors, grid, descriptor, x slice) also runs on CPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from test_kernels_w4a16 import (
    _raw_weight,
    poisoned_partials,  # noqa: F401 (a fixture: NaN in the split-K workspace)
)
from test_kernels_w4a16_mma import (
    _config_id,
    check_exact,
    check_within_fp32_bound,
    run_into,
)

from megatron_quads.kernels import w4a16_tma

CONFIGS = [
    w4a16_tma.DEFAULT_CONFIG,  # 1 warp, 64 rows, 4 stages of words and x, split 8
    # more steps per split than stages (the ring wraps: phases flip), splits past the last step
    {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 3, "num_warps": 1, "STAGES": 2, "X_RING": 1, "maxnreg": 255},
    {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 3, "num_warps": 1, "STAGES": 2, "X_RING": 0, "maxnreg": 255},
    # several warps sharing the ring (a CTA barrier a step), 8 to 32 tokens, BLOCK_K 64 and 256,
    # x through the ring or the shared slice
    {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "STAGES": 3, "X_RING": 0},
    {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "STAGES": 3, "X_RING": 1},
    {"BLOCK_M": 8, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 8, "num_warps": 2, "STAGES": 8, "X_RING": 1},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4, "num_warps": 2, "STAGES": 2, "X_RING": 0},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4, "num_warps": 2, "STAGES": 2, "X_RING": 1},
]


def _run(x: torch.Tensor, weight, config: dict[str, int]) -> torch.Tensor:
    return run_into(w4a16_tma.w4a16_tma_linear_into, x, weight, config)


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


def test_argument_errors() -> None:
    weight = _raw_weight((32, 256), "cpu")
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    out = torch.empty(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K % BLOCK_K == 0"):
        w4a16_tma.w4a16_tma_linear_into(torch.zeros(2, 192, dtype=torch.bfloat16), _raw_weight((32, 192), "cpu"), out, {})
    with pytest.raises(ValueError, match="BLOCK_N <= 256"):
        w4a16_tma.w4a16_tma_linear_into(x, weight, out, {"BLOCK_N": 512})
    with pytest.raises(ValueError, match="STAGES must be 2..8"):
        w4a16_tma.w4a16_tma_linear_into(x, weight, out, {"STAGES": 1})
    with pytest.raises(ValueError, match="X_RING 0 or 1"):
        w4a16_tma.w4a16_tma_linear_into(x, weight, out, {"X_RING": 2})
    long_x = torch.zeros(32, 8192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="raise SPLIT_K"):  # an x slice of 64 steps x 128 x 32 tokens
        w4a16_tma.w4a16_tma_linear_into(long_x, _raw_weight((32, 8192), "cpu"), torch.empty(32, 32, dtype=torch.bfloat16),
                                        {"SPLIT_K": 1, "X_RING": 0})
    with pytest.raises(ValueError, match="raise SPLIT_K"):  # 8 stages of 32 KB of words and 16 KB of x
        w4a16_tma.w4a16_tma_linear_into(long_x, _raw_weight((256, 8192), "cpu"), torch.empty(32, 256, dtype=torch.bfloat16),
                                        {"BLOCK_N": 256, "BLOCK_K": 256, "num_warps": 4, "STAGES": 8})
    with pytest.raises(ValueError, match="x must be"):
        w4a16_tma.w4a16_tma_linear_into(x.unsqueeze(0), weight, out)


def test_launch_grid_descriptor_and_slice_follow_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host side on CPU: grid, token tile from M, the descriptor's box (one stage of words)
    and the x slice's steps (a power of 2), ``maxnreg`` passed on."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(w4a16_tma, "_decode_kernel_tma", Recorder())
    x = torch.zeros(20, 768, dtype=torch.bfloat16)
    out = torch.empty(20, 96, dtype=torch.bfloat16)
    weight = _raw_weight((96, 768), "cpu")
    w4a16_tma.w4a16_tma_linear_into(x, weight, out, {"BLOCK_N": 32, "SPLIT_K": 1, "X_RING": 0})
    w4a16_tma.w4a16_tma_linear_into(x, weight, out, {"BLOCK_N": 32, "SPLIT_K": 2})
    (grid, args, kwargs), (ring_grid, ring_args, ring_kwargs) = launches
    assert grid == (3, 1, 1) and kwargs["BLOCK_M"] == 32 and kwargs["maxnreg"] == 255 and kwargs["num_warps"] == 1
    assert kwargs["X_STEPS"] == 8 and kwargs["STAGES"] == 4  # 6 K steps of 128, rounded up
    words = args[1]
    assert list(words.block_shape) == [32, 16] and list(words.shape) == [96, 96]
    assert ring_grid == (3, 2, 1) and ring_kwargs["X_STEPS"] == 0  # x through the ring: a box is one K step
    x_box = ring_args[2]
    assert list(x_box.block_shape) == [32, 2, 64] and list(x_box.shape) == [20, 12, 64] and list(x_box.strides) == [768, 64, 1]
