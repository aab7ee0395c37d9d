"""The W4A16 dispatch policy (megatron_quads.kernels.dispatch) as plain Python: a device capability
and shapes in, a kernel name out; and the entry points' ``kernel`` argument. Runs on CPU (the
warp-specialized kernels themselves are GPU-tested in tests/test_kernels_w4a16_ws*.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_quads.kernels import dispatch

BF16 = torch.bfloat16
CPU = torch.device("cpu")
H100 = dispatch.SM90
A100 = (8, 0)
B200 = (10, 0)

needs_gluon = pytest.mark.skipif(dispatch.gluon_module("w4a16_ws") is None,
                                 reason="needs a Triton with Gluon warp specialization")


def test_loads_without_triton() -> None:
    code = "import sys, megatron_quads.kernels.dispatch; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_compiled_kernels_on_cpu_or_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dispatch.device_arch(CPU) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.device_arch(torch.device("cuda", 0)) is None  # no CUDA query under the interpreter


@needs_gluon
def test_dense_policy() -> None:
    """sm_90 + bf16 + M <= 16 + K % 256 == 0 (+ unit output column stride): warp-specialized; else Triton."""
    ws = dispatch.WS_DENSE_MAX_M
    assert ws == 16
    assert [dispatch.dense_w4a16_kernel(H100, BF16, m, 4096) for m in (0, 1, ws, ws + 1, 64)] == \
        ["ws", "ws", "ws", "triton", "triton"]
    assert dispatch.dense_w4a16_kernel(H100, BF16, 8, 4096 + 128) == "triton"  # K not whole 256-column steps
    assert dispatch.dense_w4a16_kernel(H100, BF16, 8, 4096, out_column_stride=2) == "triton"
    for arch in (None, A100, B200):
        assert dispatch.dense_w4a16_kernel(arch, BF16, 8, 4096) == "triton"
    assert dispatch.dense_w4a16_kernel(H100, torch.float16, 8, 4096) == "triton"


@needs_gluon
def test_dense_reasons_name_what_is_missing() -> None:
    assert dispatch.dense_w4a16_ws_unsupported(H100, BF16, 4096) is None
    assert dispatch.dense_w4a16_ws_unsupported(H100, BF16, 4096 + 128) is not None  # M does not matter here
    assert "sm_90" in dispatch.dense_w4a16_ws_unsupported(None, BF16, 4096)
    assert "8.0" in dispatch.dense_w4a16_ws_unsupported(A100, BF16, 4096)
    assert "bfloat16" in dispatch.dense_w4a16_ws_unsupported(H100, torch.float16, 4096)
    assert "K % 256 == 0" in dispatch.dense_w4a16_ws_unsupported(H100, BF16, 640)
    assert "column stride" in dispatch.dense_w4a16_ws_unsupported(H100, BF16, 4096, out_column_stride=3)


@needs_gluon
def test_grouped_policy() -> None:
    """sm_90 + bf16 + x in K order + K % 128 == 0 + a tail of whole 256-column steps (K % 256 == 0):
    warp-specialized; else Triton."""
    assert dispatch.grouped_w4a16_kernel(H100, BF16, 2048) == "ws"
    assert dispatch.grouped_w4a16_kernel(H100, BF16, 640) == "ws"  # 128-wide ring steps
    assert dispatch.grouped_w4a16_kernel(H100, BF16, 2048, x_mma_order=False) == "triton"
    assert dispatch.grouped_w4a16_kernel(H100, BF16, 2048 + 64) == "triton"
    assert dispatch.grouped_w4a16_kernel(H100, BF16, 768, 256) == "ws"
    assert dispatch.grouped_w4a16_kernel(H100, BF16, 768, 512) == "ws"
    assert dispatch.grouped_w4a16_kernel(H100, BF16, 768, 96) == "triton"  # widen it first
    assert dispatch.grouped_w4a16_kernel(H100, BF16, 640, 256) == "triton"  # no 256-wide steps at K 640
    for arch in (None, A100, B200):
        assert dispatch.grouped_w4a16_kernel(arch, BF16, 2048) == "triton"
    assert dispatch.grouped_w4a16_kernel(H100, torch.float16, 2048) == "triton"
    assert "K order" in dispatch.grouped_w4a16_ws_unsupported(H100, BF16, 2048, x_mma_order=False)
    assert "K % 128 == 0" in dispatch.grouped_w4a16_ws_unsupported(H100, BF16, 192)
    assert "RAC tail" in dispatch.grouped_w4a16_ws_unsupported(H100, BF16, 768, 96)


@needs_gluon
def test_warp_specialized_grouped_and_tail_width_follow_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dispatch.warp_specialized_grouped(CPU, 2048) is None
    assert dispatch.warp_specialized_tail_width(CPU, 768, 96) == 0
    monkeypatch.setattr(dispatch, "device_arch", lambda device: H100)
    assert dispatch.warp_specialized_grouped(CPU, 2048) is dispatch.gluon_module("w4a16_ws")
    assert dispatch.warp_specialized_grouped(CPU, 768, 96) is None and dispatch.warp_specialized_grouped(CPU, 768, 256)
    assert [dispatch.warp_specialized_tail_width(CPU, 768, s) for s in (0, 96, 256, 300)] == [0, 256, 256, 512]
    monkeypatch.setattr(dispatch, "device_arch", lambda device: A100)
    assert dispatch.warp_specialized_grouped(CPU, 2048) is None


@needs_gluon
def test_x_order_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """x in the K order of 128-blocks where the kernels run it, bf16, >= 1 mean row an expert, K % 128 == 0."""
    assert dispatch.X_ORDER_MIN_ROWS_PER_EXPERT == 1
    assert dispatch.x_order_block(True, BF16, 1, 2048) == 128
    assert dispatch.x_order_block(True, BF16, 0.5, 2048) is None
    assert dispatch.x_order_block(False, BF16, 64, 2048) is None
    assert dispatch.x_order_block(True, torch.float16, 64, 2048) is None
    assert dispatch.x_order_block(True, BF16, 64, 2048 + 64) is None
    monkeypatch.setattr(dispatch, "X_ORDER_MIN_ROWS_PER_EXPERT", 1 << 30)  # read at each call
    assert dispatch.x_order_block(True, BF16, 64, 2048) is None


@needs_gluon
def test_kernel_argument_resolves_through_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    x, out = torch.zeros(8, 4096, dtype=BF16), torch.zeros(8, 512, dtype=BF16)
    assert dispatch.resolve_dense_w4a16(None, None, x, 4096, out) == "triton"  # CPU
    assert dispatch.resolve_dense_w4a16("triton", None, x, 4096, out) == "triton"
    with pytest.raises(ValueError, match="kernel='ws' cannot run this dense W4A16 call: it needs an sm_90 GPU"):
        dispatch.resolve_dense_w4a16("ws", None, x, 4096, out)
    with pytest.raises(ValueError, match="kernel must be None"):
        dispatch.resolve_dense_w4a16("cublas", None, x, 4096, out)
    monkeypatch.setattr(dispatch, "device_arch", lambda device: H100)
    assert dispatch.resolve_dense_w4a16(None, None, x, 4096, out) == "ws"
    assert dispatch.resolve_dense_w4a16(None, {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2}, x, 4096, out) == "triton"
    assert dispatch.resolve_dense_w4a16("ws", {"SPLIT_K": 2}, torch.zeros(64, 4096, dtype=BF16), 4096, out) == "ws"
    with pytest.raises(ValueError, match="K % 256 == 0"):
        dispatch.resolve_dense_w4a16("ws", None, x[:, :640], 640, out)
    assert dispatch.resolve_grouped_w4a16(None, None, x, 4096, 0, True) == "ws"
    assert dispatch.resolve_grouped_w4a16(None, None, x, 4096, 0, False) == "triton"
    assert dispatch.resolve_grouped_w4a16("triton", None, x, 4096, 0, True) == "triton"
    with pytest.raises(ValueError, match="grouped W4A16 call: it takes x in the kernel's K order"):
        dispatch.resolve_grouped_w4a16("ws", None, x, 4096, 0, False)


@needs_gluon
def test_entry_points_take_the_kernel_argument() -> None:
    """On CPU both W4A16 entry points refuse ``kernel="ws"`` with the reason (before any launch)."""
    from megatron_quads.kernels import w4a16
    from megatron_quads.nvfp4 import quantize

    weight = quantize(torch.randn(64, 256))
    x = torch.zeros(4, 256, dtype=BF16)
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        w4a16.w4a16_linear_into(x, weight, torch.empty(4, 64, dtype=BF16), kernel="ws")
    stacked = quantize(torch.randn(2, 64, 256))
    offsets = torch.tensor([0, 1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        w4a16.grouped_w4a16_into(x, stacked, offsets, torch.empty(4, 64, dtype=BF16), x_mma_order=True, kernel="ws")
    with pytest.raises(ValueError, match="kernel must be None"):
        w4a16.grouped_w4a16_into(x, stacked, offsets, torch.empty(4, 64, dtype=BF16), kernel="gluon")
