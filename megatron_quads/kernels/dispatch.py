"""Which kernel runs a W4A16 GEMM of the rollout side: one policy, from the device, the dtype and
the shapes.

:func:`~megatron_quads.kernels.w4a16.w4a16_linear_into` and
:func:`~megatron_quads.kernels.w4a16.grouped_w4a16_into` follow it when their ``kernel`` argument is
None; ``kernel="triton"`` or ``kernel="ws"`` picks one (tests, benchmarks), and ``"ws"`` raises
``ValueError`` saying why where the warp-specialized kernel cannot run the call. A ``config``
without ``kernel`` names the Triton kernel's tiles, so it runs the Triton kernel.

================  =======================================================  ===================================
call              when (every condition)                                   kernel
================  =======================================================  ===================================
dense W4A16       sm_90, bf16, ``M <= 16`` (:data:`WS_DENSE_MAX_M`),       warp-specialized dense
                  ``K % 256 == 0``, unit output column stride, no config   (``w4a16_ws_dense``)
..                otherwise                                                Triton dense (split-K)
grouped W4A16     sm_90, bf16, x in the kernel's K order,                  warp-specialized grouped
                  ``K % 128 == 0``, no RAC tail or one of whole            (``w4a16_ws``)
                  256-column steps with ``K % 256 == 0``, no config
..                otherwise                                                Triton grouped
grouped x order   the kernels run x (``use_kernels``), bf16, mean          x in the K order of 128-column
                  routed rows per expert >= 1                              blocks (``mma_k_order_rows``)
                  (:data:`X_ORDER_MIN_ROWS_PER_EXPERT`), ``K % 128 == 0``
..                otherwise                                                natural order
grouped RAC tail  the warp-specialized grouped kernel takes K              the tail widened to whole
                  (:func:`warp_specialized_tail_width`) and widening       256-column steps
                  grows ``K + S`` by at most ``w4a4.TAIL_PAD_MAX_GROWTH``  (``w4a4.padded_tail``)
W4A4 + RAC        no ``GemmConfig``                                        the W4A16 rows above, over the
                                                                           prologue's bf16 block values
..                a ``GemmConfig``                                         the RAC GEMM (``_rac_gemm_kernel``)
================  =======================================================  ===================================

"sm_90" is a CUDA device of compute capability 9.0 (H100 / H200: wgmma and TMA), outside
``TRITON_INTERPRET=1``, with a Triton whose Gluon has warp specialization (3.6). The thresholds rest
on measurements: ``benchmarks/bench_kernels.py`` sections ``w4a16_ws_dense`` (the 16-row bound),
``grouped`` (the x-order bound), ``grouped_ws`` and ``rac`` (docs/kernels.md has the numbers).

Only plain Python: the Gluon modules are imported on first use, so this module loads without Triton.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from types import ModuleType

import torch

KERNELS = ("triton", "ws")
"""The values of the entry points' ``kernel`` argument besides None (the policy): the Triton kernel,
or the warp-specialized Gluon one."""

SM90 = (9, 0)
"""The compute capability the warp-specialized kernels are built for (wgmma, TMA)."""

WS_DENSE_MAX_M = 16
"""The most rows the dense policy sends to the warp-specialized kernel (its 16-row token tile, x
reordered by its x warps); beyond, the Triton kernel was the faster
(``benchmarks/bench_kernels.py --only w4a16_ws_dense``)."""

X_ORDER_MIN_ROWS_PER_EXPERT = 1
"""Mean routed rows per expert from which the grouped path takes x in the kernel's K order (and so,
on sm_90, the warp-specialized grouped kernel): from 2 rows an expert (32 tokens, top-8 of 128) that
kernel saved 9-16% of gate/up and down together over the Triton one, more than the 2.5-3 us the
reordering of the tokens' rows costs; at 0.5 rows an expert (8 tokens) the two kernels were within
2% and the reordering a loss (``tools/tune_grouped_w4a16.py`` on an H200,
benchmarks/results/grouped_tiles_gpu.json)."""

X_ORDER_BLOCK_K = 128
"""BLOCK_K of the grouped kernels' ``x_mma_order`` path (the K order depends on it), and the block of
their ``y_mma_order`` output: the layout :func:`x_order_block` hands out and the kernels take."""

_WS_DENSE_STEP = 256
"""K step of the warp-specialized dense kernel (two 128-column K-order blocks)."""


@functools.cache
def gluon_module(name: str) -> ModuleType | None:
    """The Gluon kernel module ``megatron_quads.kernels.<name>`` (``w4a16_ws``, ``w4a16_ws_dense``),
    or None where this Triton lacks what it needs (Gluon's warp specialization, Hopper wgmma and TMA)."""
    try:
        return importlib.import_module(f"megatron_quads.kernels.{name}")
    except (ImportError, AttributeError):
        return None


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def device_arch(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of ``device`` where compiled kernels run on it, None for a CPU device
    or under ``TRITON_INTERPRET=1``."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return _capability(device)


def _ws_blocker(arch: tuple[int, int] | None, dtype: torch.dtype, module: str) -> str | None:
    """Why no warp-specialized kernel runs here at all (device, dtype, Triton), or None."""
    if arch != SM90:
        where = "a CPU or the Triton interpreter" if arch is None else f"compute capability {arch[0]}.{arch[1]}"
        return f"it needs an sm_90 GPU (here: {where})"
    if dtype != torch.bfloat16:
        return f"it takes bfloat16 activations, got {dtype}"
    if gluon_module(module) is None:
        return "this Triton has no Gluon warp specialization (Triton 3.6 has it)"
    return None


def dense_w4a16_ws_unsupported(arch: tuple[int, int] | None, dtype: torch.dtype, k: int,
                               out_column_stride: int = 1) -> str | None:
    """Why the warp-specialized dense kernel cannot run a dense W4A16 call (``arch`` from
    :func:`device_arch`, x's dtype, the weight's K, the output's column stride), or None."""
    why = _ws_blocker(arch, dtype, "w4a16_ws_dense")
    if why is None and k % _WS_DENSE_STEP:
        why = f"it needs K % {_WS_DENSE_STEP} == 0 (its ring step), got K={k}"
    if why is None and out_column_stride != 1:
        why = f"it stores output rows with unit column stride, got stride {out_column_stride}"
    return why


def dense_w4a16_kernel(arch: tuple[int, int] | None, dtype: torch.dtype, m: int, k: int,
                       out_column_stride: int = 1) -> str:
    """The policy's kernel for a dense W4A16 call of ``m`` rows (no config): ``"ws"`` on sm_90 for bf16,
    ``m <= WS_DENSE_MAX_M``, ``K % 256 == 0`` and unit output column stride, else ``"triton"``."""
    if m <= WS_DENSE_MAX_M and dense_w4a16_ws_unsupported(arch, dtype, k, out_column_stride) is None:
        return "ws"
    return "triton"


def grouped_w4a16_ws_unsupported(arch: tuple[int, int] | None, dtype: torch.dtype, k: int, k2: int = 0,
                                 x_mma_order: bool = True) -> str | None:
    """Why the warp-specialized grouped kernel cannot run a grouped W4A16 call (``arch`` from
    :func:`device_arch`, x's dtype, the weight's K, the RAC tail's ``k2`` columns, whether x is in
    the kernel's K order), or None."""
    why = _ws_blocker(arch, dtype, "w4a16_ws")
    if why is None and not x_mma_order:
        why = "it takes x in the kernel's K order only (x_mma_order=True)"
    if why is None and k % 128:
        why = f"it needs K % 128 == 0 (whole K-order blocks), got K={k}"
    if why is None and k2 and not gluon_module("w4a16_ws").takes_tail(k, k2):
        why = (f"a RAC tail must be whole 256-column ring steps with K % 256 == 0, got K={k}, K2={k2} "
               "(widen it: warp_specialized_tail_width)")
    return why


def grouped_w4a16_kernel(arch: tuple[int, int] | None, dtype: torch.dtype, k: int, k2: int = 0,
                         x_mma_order: bool = True) -> str:
    """The policy's kernel for a grouped W4A16 call (no config): ``"ws"`` wherever the warp-specialized
    grouped kernel runs it (:func:`grouped_w4a16_ws_unsupported`), else ``"triton"``."""
    return "ws" if grouped_w4a16_ws_unsupported(arch, dtype, k, k2, x_mma_order) is None else "triton"


def _resolve(kernel: str | None, config: dict | None, policy: Callable[[], str],
             unsupported: Callable[[], str | None], call: str) -> str:
    """``kernel`` checked (None: the policy, or the Triton kernel when a config is given)."""
    if kernel is None:
        return "triton" if config is not None else policy()
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be None (the dispatch policy), 'triton' or 'ws', got {kernel!r}")
    if kernel == "ws" and (why := unsupported()) is not None:
        raise ValueError(f"kernel='ws' cannot run this {call}: {why}")
    return kernel


def resolve_dense_w4a16(kernel: str | None, config: dict | None, x2: torch.Tensor, k: int,
                        out2: torch.Tensor) -> str:
    """The kernel that runs ``w4a16_linear_into`` on ``x2 [M, K]`` into ``out2 [M, N]``."""
    arch = device_arch(x2.device)
    return _resolve(kernel, config,
                    lambda: dense_w4a16_kernel(arch, x2.dtype, x2.shape[0], k, out2.stride(-1)),
                    lambda: dense_w4a16_ws_unsupported(arch, x2.dtype, k, out2.stride(-1)), "dense W4A16 call")


def resolve_grouped_w4a16(kernel: str | None, config: dict | None, x: torch.Tensor, k: int, k2: int,
                          x_mma_order: bool) -> str:
    """The kernel that runs ``grouped_w4a16_into`` on ``x [T, K + K2]``."""
    arch = device_arch(x.device)
    return _resolve(kernel, config, lambda: grouped_w4a16_kernel(arch, x.dtype, k, k2, x_mma_order),
                    lambda: grouped_w4a16_ws_unsupported(arch, x.dtype, k, k2, x_mma_order), "grouped W4A16 call")


def warp_specialized_grouped(device: torch.device, k: int, k2: int = 0) -> ModuleType | None:
    """The ``w4a16_ws`` module where the grouped policy hands it a bf16 x-in-K-order call with ``K = k``
    and a RAC tail of ``k2`` columns, else None. The W4A4 + RAC prologue asks it too, to write its
    values in that kernel's K order."""
    if grouped_w4a16_ws_unsupported(device_arch(device), torch.bfloat16, k, k2) is not None:
        return None
    return gluon_module("w4a16_ws")


def warp_specialized_tail_width(device: torch.device, k: int, k2: int) -> int:
    """The narrowest tail of at least ``k2`` columns that the warp-specialized grouped kernel takes
    with ``K = k`` (``k2`` rounded up to its ring step) where the grouped policy hands it calls, else 0."""
    ws = warp_specialized_grouped(device, k)
    step = ws.tail_step(k) if ws is not None and k2 else 0
    return -(-k2 // step) * step if step else 0


def x_order_block(kernels_run: bool, dtype: torch.dtype, rows_per_expert: float, k: int) -> int | None:
    """The K-order block (``X_ORDER_BLOCK_K``) in which the grouped W4A16 path should take x of
    ``k`` columns, or None (natural order): where the kernels run x (``kernels_run``:
    :func:`~megatron_quads.nvfp4.backend.use_kernels`), bf16, at least
    :data:`X_ORDER_MIN_ROWS_PER_EXPERT` mean routed rows per expert and ``k`` a multiple of the block."""
    if not kernels_run or dtype != torch.bfloat16 or rows_per_expert < X_ORDER_MIN_ROWS_PER_EXPERT:
        return None
    return X_ORDER_BLOCK_K if k % X_ORDER_BLOCK_K == 0 else None
