"""The warp-specialized dense decode W4A16 kernel (``w4a16_ws_dense``) against the fp64 oracle.

Bit for bit on inputs whose fp32 sums are exact, within the fp32 accumulation bound on realistic
and raw weights, outputs and the split-K workspace NaN-poisoned, the arrival counters back at zero after every call. Split-K partials are
summed in split order, so with the Triton dense kernel's split boundaries the result is its bits.
Gluon kernels need the GPU; the argument checks, the split rules and the offline sm_90 compile run
on CPU (with Triton installed).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from test_kernels_w4a16 import (
    _activations,
    _assert_within,
    _exact_expected,
    _gaussian_weight,
    _grid_activations,
    _oracle,
    _raw_weight,
    _same_bits,
    _tolerance,
    poisoned_partials,  # noqa: F401 (a fixture: NaN in the split-K workspace)
)

from megatron_quads.kernels import dispatch, w4a16, w4a16_ws_dense

CONFIGS: list[dict[str, Any]] = [
    {},  # defaults: split from the shape, x reordered by the kernel's x warps
    {"X_WARPS": 1},
    {"X_WARPS": 4, "STAGES": 2, "PROGRAMS": 7},
    {"SPLIT_K": 3},  # uneven splits (and fewer than asked where a split would be empty)
    {"SPLIT_K": 1},  # no partials: the direct epilogue
    {"SPLIT_K": 2, "PROGRAMS": 3},  # several token tiles; persistent programs wrap the ring
    {"BLOCK_N": 64, "num_warps": 4, "STAGES": 4, "CTAS_PER_SM": 3},
    {"BLOCK_N": 256, "num_warps": 16, "STAGES": 2, "CTAS_PER_SM": 1, "maxnreg": 0},
    {"STAGES": 2, "PROGRAMS": 5},
    {"BLOCK_N": 128, "num_warps": 8, "CTAS_PER_SM": 2, "SPLIT_K": 4},
]


SHAPES = [(1, 40, 512), (3, 72, 256), (16, 200, 1024), (17, 24, 512), (64, 4096 + 40, 2048), (16, 2048, 4096)]
"""(M, N, K): 1..64 tokens (several token tiles at 17 and 64), N not a multiple of the tile; K a
multiple of 256 (the kernel's ring step)."""


def _run_into(linear_into: Callable, x: torch.Tensor, weight, config: dict[str, int]) -> torch.Tensor:
    """``linear_into(x, weight, out, config)`` into a NaN-filled ``out``; the split-K counters must be back at 0."""
    out = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    assert linear_into(x, weight, out, config) is out
    assert all(int(c.abs().sum()) == 0 for c in w4a16._COUNTERS.values()), "split-K counters were not reset"
    return out


def _check_exact(run: Callable[[torch.Tensor, object], torch.Tensor], device: str) -> None:
    """``run(x, weight)`` bit for bit on every shape of :data:`SHAPES`, inputs whose fp32 sums are exact."""
    for m, n, k in SHAPES:
        for decode in (None, 2.0**-7):
            weight = _raw_weight((n, k), device, scale_bytes=(0x28, 0x4F), decode=decode)
            x = _grid_activations((m, k), torch.bfloat16, device, bound=8 if k <= 256 else 1)
            assert _same_bits(run(x, weight), _exact_expected(x, weight, torch.bfloat16)), (m, n, k, decode)


def _check_within_fp32_bound(run: Callable[[torch.Tensor, object], torch.Tensor], device: str) -> None:
    """``run(x, weight)`` within the fp32 accumulation bound on every shape, realistic and raw weights."""
    for m, n, k in SHAPES:
        for weight in (_gaussian_weight((n, k), device), _raw_weight((n, k), device)):
            x = _activations((m, k), torch.bfloat16, device)
            exact, magnitude = _oracle(x, weight)
            _assert_within(run(x, weight), exact, _tolerance(exact, magnitude, k, torch.bfloat16))


def _on_gpu(test: Callable) -> Callable:
    """A GPU test of a Gluon kernel: the Triton interpreter cannot run Gluon, so it is skipped
    without a CUDA device even under ``TRITON_INTERPRET=1``."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(),
                                              reason="Gluon kernels need a CUDA GPU")(test))


def _config_id(config: dict[str, Any]) -> str:
    return "-".join(f"{k[0]}{k[-1]}{v}" for k, v in config.items()) or "default"


def _run(x: torch.Tensor, weight, config: dict[str, Any]) -> torch.Tensor:
    return _run_into(w4a16_ws_dense.w4a16_ws_linear_into, x, weight, config)


@_on_gpu
@pytest.mark.usefixtures("poisoned_partials")
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_exact_on_exactly_summable_inputs(kernel_device: str, config: dict[str, Any]) -> None:
    _check_exact(lambda x, weight: _run(x, weight, config), kernel_device)


@_on_gpu
@pytest.mark.usefixtures("poisoned_partials")
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_within_fp32_accumulation_error(kernel_device: str, config: dict[str, Any]) -> None:
    _check_within_fp32_bound(lambda x, weight: _run(x, weight, config), kernel_device)


@_on_gpu
@pytest.mark.usefixtures("poisoned_partials")
@pytest.mark.parametrize("m", [1, 16, 40])
def test_triton_split_boundaries_give_the_triton_bits(kernel_device: str, m: int) -> None:
    """Split 4 of K 4096 in both kernels (ring steps of 256 here, K tiles of 128 there): the same
    per-split sums in the same K order, added in split order: equal bits (x a strided view, which
    the x warps read in place)."""
    weight = _gaussian_weight((1024 + 64, 4096), kernel_device)
    x = _activations((m, 4096 + 64), torch.bfloat16, kernel_device)[:, 32:4096 + 32]  # rows 4160 apart
    triton_out = torch.empty(m, 1024 + 64, dtype=torch.bfloat16, device=kernel_device)
    w4a16.w4a16_linear_into(x, weight, triton_out, {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4})
    ours = _run(x, weight, {"SPLIT_K": 4})
    assert torch.equal(ours, triton_out)


@_on_gpu
def test_w4a16_linear_into_dispatches_decode_calls_here(kernel_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a config, up to ``dispatch.WS_DENSE_MAX_M`` rows with K a multiple of 256 go to this
    kernel (its bits); more rows, or K that 256 does not divide, stay with the Triton kernel."""
    calls = []
    real = w4a16_ws_dense.w4a16_ws_linear_into
    monkeypatch.setattr(w4a16_ws_dense, "w4a16_ws_linear_into", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    weight = _gaussian_weight((512, 1024), kernel_device)
    for m in (1, dispatch.WS_DENSE_MAX_M, dispatch.WS_DENSE_MAX_M + 1):
        x = _activations((m, 1024), torch.bfloat16, kernel_device)
        before = len(calls)
        dispatched = w4a16.w4a16_linear_kernel(x, weight)
        assert len(calls) - before == (m <= dispatch.WS_DENSE_MAX_M)
        if m <= dispatch.WS_DENSE_MAX_M:
            assert torch.equal(dispatched, real(x, weight, torch.empty_like(dispatched)))
    before = len(calls)
    w4a16.w4a16_linear_kernel(_activations((4, 640), torch.bfloat16, kernel_device),
                              _gaussian_weight((512, 640), kernel_device))
    assert len(calls) == before
    x = _activations((40, 1024), torch.bfloat16, kernel_device)
    w4a16.w4a16_linear_into(x[:4], weight, torch.empty(4, 512, dtype=torch.bfloat16, device=kernel_device),
                            kernel="triton")
    assert len(calls) == before
    forced = w4a16.w4a16_linear_into(x, weight, torch.empty(40, 512, dtype=torch.bfloat16, device=kernel_device),
                                     kernel="ws")  # more rows than the policy sends: several token tiles
    assert len(calls) == before + 1
    assert torch.equal(forced, real(x, weight, torch.empty_like(forced)))


def test_split_rules() -> None:
    # one wave of 264 programs: 64 N tiles of 8192 take 4 splits, 32 of 4096 take 8 (steps permitting)
    assert w4a16_ws_dense.default_split(64, 32, 264) == 4
    assert w4a16_ws_dense.default_split(32, 16, 264) == 8
    assert w4a16_ws_dense.default_split(32, 4, 264) == 4  # no more splits than steps divide evenly
    assert w4a16_ws_dense.default_split(300, 32, 264) == 1
    assert w4a16_ws_dense.split_count(5, 4) == 3  # 2 steps a split: the fourth would be empty
    assert w4a16_ws_dense.split_count(1, 8) == 1
    assert w4a16_ws_dense.split_count(32, 3) == 3


def test_config_defaults_follow_the_shape() -> None:
    cpu = torch.device("cpu")
    small = w4a16_ws_dense.resolve_config(16, 8192, 8192, cpu, None)  # 128 N tiles of 64, 3 x 132 programs
    assert (small["BLOCK_M"], small["BLOCK_N"], small["STAGES"], small["SPLIT_K"], small["X_WARPS"]) == (16, 64, 3, 2, 2)
    assert w4a16_ws_dense.resolve_config(16, 8192, 8192, cpu, {"BLOCK_N": 128, "num_warps": 8})["SPLIT_K"] == 4
    more_rows = w4a16_ws_dense.resolve_config(64, 8192, 8192, cpu, None)  # four token tiles of 16
    assert (more_rows["BLOCK_M"], more_rows["BLOCK_N"], more_rows["SPLIT_K"]) == (16, 64, 1)
    assert w4a16_ws_dense.resolve_config(16, 8192, 8192, cpu, {"STAGES": 4})["STAGES"] == 4


def test_argument_errors() -> None:
    weight = _raw_weight((256, 512), "cpu")
    x = torch.zeros(4, 512, dtype=torch.bfloat16)
    out = torch.empty(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K % 256 == 0"):
        w4a16_ws_dense.w4a16_ws_linear_into(torch.zeros(4, 384, dtype=torch.bfloat16), _raw_weight((256, 384), "cpu"),
                                            out)
    with pytest.raises(ValueError, match="num_warps = BLOCK_N / 16"):
        w4a16_ws_dense.w4a16_ws_linear_into(x, weight, out, {"BLOCK_N": 128})  # on the decode config's 4 warps
    with pytest.raises(ValueError, match="do not fit in shared memory"):
        w4a16_ws_dense.w4a16_ws_linear_into(x, weight, out, {"BLOCK_N": 256, "num_warps": 16, "STAGES": 8})
    with pytest.raises(ValueError, match="BLOCK_M must be 16"):
        w4a16_ws_dense.w4a16_ws_linear_into(x, weight, out, {"BLOCK_M": 32})
    with pytest.raises(ValueError, match="X_WARPS must be 1, 2 or 4"):
        w4a16_ws_dense.w4a16_ws_linear_into(x, weight, out, {"X_WARPS": 0})
    with pytest.raises(TypeError, match="take bfloat16 activations"):
        w4a16_ws_dense.w4a16_ws_linear_into(x.float(), weight, out)
    with pytest.raises(ValueError, match="out must be"):
        w4a16_ws_dense.w4a16_ws_linear_into(x, weight, torch.empty(4, 255, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[N, K\] weight"):
        w4a16_ws_dense.w4a16_ws_linear_into(x, _raw_weight((2, 256, 512), "cpu"), out)


def _ops(sass: str) -> collections.Counter:
    return collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)", sass, re.MULTILINE))


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_every_config_compiles_for_sm90(config: dict[str, Any]) -> None:
    """The kernel builds for sm_90 without a GPU, with the wgmma and the loader's two TMA copies a
    step (words, scale bytes); the split-K arrival (a gpu-scope atomic, then the counter's reset)
    only with splits; the MMA warps' barriers on their own threads (``bar.sync 0, 32 num_warps``),
    never the whole CTA with the loader and x warps."""
    cfg = w4a16_ws_dense.resolve_config(16, 1024, 4096, torch.device("cpu"), config)
    out = w4a16_ws_dense.compile_offline(cfg, 1024, 4096)
    ops = _ops(out["sass"])
    assert ops["HGMMA"] > 0 and ops["UTMALDG"] == 2
    assert (ops["ATOMG"] > 0) == (cfg["SPLIT_K"] > 1)
    assert set(re.findall(r"bar\.sync\s+0, (\d+);", out["ptx"])) == {str(32 * cfg["num_warps"])}


def test_x_warps_move_x_in_16_byte_loads_and_4_byte_stores() -> None:
    """Offline sm_90 SASS of the x warps' reordering: a 256-wide step of 16 token rows is 16 bytes
    a thread a load (8 consecutive columns) and a bf16 pair a shared store (columns ``2 t``, ``2 t + 1``
    are natural columns 4 apart: one PRMT a pair), and the stores are fenced for the wgmma's reads."""
    cfg = w4a16_ws_dense.resolve_config(16, 1024, 4096, torch.device("cpu"), {"X_WARPS": 1})
    out = w4a16_ws_dense.compile_offline(cfg, 1024, 4096)
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+(?:\.[A-Z0-9]+)*)",
                                         out["sass"], re.MULTILINE))
    assert ops["LDG.E.128"] == 16 * 32 * 8 * 2 // (32 * 16)  # 8 KB a step, one warp
    assert ops["STS"] >= 64 and "fence.proxy.async.shared::cta" in out["ptx"]
