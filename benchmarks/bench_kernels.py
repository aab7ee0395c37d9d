"""NVFP4 Triton and Gluon kernels on the GPU, side by side with BF16 and FP8 in one run.

    python benchmarks/bench_kernels.py [--quick] [--only SECTION ...] [--dense-shape M,K,N ...]
    python benchmarks/bench_kernels.py --render     # only rewrite kernels_gpu.md (no GPU)

Sections (each row: time, bytes moved, FLOPs, and the fraction of the byte floor reached; ``--only``
picks sections, the first five run by default):

- ``quantize``: quantize (1x16 given amax, 1x16 with the amax pass, 16x16) and fake quant of an
  8192 x 8192 bf16 tensor, and the PyTorch reference: GB/s against the device-to-device copy
  bandwidth measured in the same run (target >= 70% of it).
- ``w4a16``: the W4A16 linear as dispatched (``kernel=None``) at decode shapes (M = 1..64; K, N =
  2048..8192) against BF16 ``torch.matmul``, FP8 ``torch._scaled_mm`` (M padded to 16 for cuBLAS
  FP8) and the Triton kernel (``kernel="triton"``); the dispatched kernel and FP8 also L2-cold. The
  FP4 byte floor is (packed weights + scales + activations + output) / copy bandwidth. Targets at
  K, N >= 4096, M <= 16: >= 1.6x faster than FP8 and >= 75% of the byte floor; faster than FP8 to M = 64.
- ``grouped``: the Triton grouped MoE W4A16 kernel at Qwen3-30B-A3B expert shapes (128 experts,
  hidden 2048, expert ffn 768, top-8; gate+up N = 1536 and down) for 64..512 decode tokens against
  BF16 ``torch._grouped_mm`` (target >= 2.5x faster), per token tile, and on x in its K order.
- ``grouped_ws``: the warp-specialized Gluon grouped kernel (the engine's for x in its K order on
  sm_90) at its defaults and a config sweep, each checked against the Triton kernel first.
- ``rac``: W4A4 + RAC per residual ratio against plain W4A4 (ratio 0), dense and grouped, on the
  default path and on the RAC GEMM; no target.
- ``quantize_tiles``: the quantize kernels' tile and persistent-loop configs swept (the evidence
  for their defaults).
- ``w4a16_ws_dense``: the warp-specialized dense decode kernel at its defaults and a config sweep,
  on natural x and on x in its K order (``--dense-shape`` replaces its shapes).
- ``moe_layer``: the engine's grouped MoE layer (W4A16), routing to combine, against the same
  forward with x in natural order and with the Triton grouped kernel.
- ``rac_ws``: grouped W4A4 + RAC with its GEMM on the warp-specialized kernel (the default on sm_90
  where the tail fits, widened where that costs little) against the Triton kernel on natural-order values.

GEMMs are timed by CUDA-graph replay. Results: benchmarks/results/kernels_gpu.json (the newest
record of each section: date, device, command, copy bandwidth, rows) and kernels_gpu.md.
"""

# ruff: noqa: B023 -- every lambda is timed (and its graph replayed) before the loop moves on
from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import statistics
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from unittest import mock

import torch
from results_io import load_records, save_record, write_text_atomic

from megatron_quads.nvfp4 import quantize
from megatron_quads.nvfp4.reblock import reblock_columns
from megatron_quads.rollout.grouped import expert_offsets_from_counts, expert_weight
from megatron_quads.rollout.rac import (
    num_residual_channels,
    select_channels,
)

DEV = "cuda"
EAGER_TIMED: set[str] = set()


def time_graph(fn: Callable[[], object], calls: int = 20, repeats: int = 10, eager_reason: str | None = None) -> float:
    """Median microseconds per call, replaying a CUDA graph of ``calls`` calls (events if capture fails).

    ``eager_reason`` skips the capture for work that cannot be captured (a host sync): a failed
    capture can leave the CUDA RNG unusable for the rest of the process.
    """
    for _ in range(3):
        fn()  # warm-up: Triton autotuning and compilation happen outside the capture
    torch.cuda.synchronize()
    try:
        if eager_reason is not None:
            raise RuntimeError(eager_reason)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    fn()
        if any("empty" in str(w.message) for w in caught):
            raise RuntimeError("the captured CUDA graph is empty (work launched outside the capture stream)")
        run = graph.replay
    except RuntimeError as err:
        EAGER_TIMED.add(f"{getattr(fn, '__qualname__', fn)}: {str(err).splitlines()[0][:80]}")

        def run() -> None:
            for _ in range(calls):
                fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write): the faster of two ways to copy 1 GiB."""
    src = torch.empty(2**28, dtype=torch.float32, device=DEV).uniform_()
    dst = torch.empty_like(src)
    best = min(time_graph(lambda: dst.copy_(src), calls=20), time_graph(lambda: torch.mul(src, 1.0, out=dst), calls=5))
    return 2 * src.numel() * 4 / (best * 1e-6)


def row(case: str, us: float, nbytes: float, flops: float, bandwidth: float, **extra) -> dict:
    """One result row with the achieved rates and the fraction of the byte floor."""
    return {"case": case, "us": round(us, 2), "MB": round(nbytes / 1e6, 3), "GFLOP": round(flops / 1e9, 4),
            "GBps": round(nbytes / (us * 1e-6) / 1e9, 1), "TFLOPs": round(flops / (us * 1e-6) / 1e12, 2),
            "floor_us": round(nbytes / bandwidth * 1e6, 2), "frac_of_floor": round(nbytes / bandwidth / (us * 1e-6), 3),
            **extra}


def bench_quantize(bandwidth: float, size: int) -> list[dict]:
    """Quantize / fake-quant throughput of a size x size bf16 tensor."""
    from megatron_quads.nvfp4.quantize_kernel import fake_quant_kernel, quantize_kernel

    x = torch.randn(size, size, device=DEV, dtype=torch.bfloat16)
    amax = x.abs().amax().float()
    n = x.numel()
    q_bytes = n * 2 + n // 2 + n // 16
    rows = [  # validate=False: the NaN scan syncs with the host and cannot be graph-captured
        row("quantize 1x16, amax given", time_graph(lambda: quantize_kernel(x, amax, validate=False), calls=5), q_bytes, 0, bandwidth),
        row("quantize 1x16, amax pass", time_graph(lambda: quantize_kernel(x, validate=False), calls=5), q_bytes + n * 2, 0, bandwidth),
        row("quantize 16x16, amax given", time_graph(lambda: quantize_kernel(x, amax, block_2d=True, validate=False), calls=5),
            q_bytes, 0, bandwidth),
        row("fake quant 1x16", time_graph(lambda: fake_quant_kernel(x, amax), calls=5), n * 4, 0, bandwidth),
    ]
    from megatron_quads.nvfp4.fused import fake_quant_values
    from megatron_quads.nvfp4.backend import reference_path

    with reference_path():
        rows.append(row("fake quant 1x16, torch reference", time_graph(lambda: fake_quant_values(x, amax), calls=2), n * 4, 0, bandwidth))
        rows.append(row("quantize 1x16, torch reference (validated)", time_graph(lambda: quantize(x, global_amax=amax), calls=2,
                                                                                 eager_reason="validation syncs with the host"),
                        q_bytes, 0, bandwidth))
    return rows


@contextlib.contextmanager
def quantize_config(tile: tuple[int, int, int] | None = None, loop: int | None = None) -> Iterator[None]:
    """Pin the quantize kernels' launch config for a sweep (None keeps a choice's default): the tile
    ``(rows, 16-element blocks, warps)`` and the persistent loop's programs per SM. The
    kernels take no config argument; these are the functions they ask for it
    (``quantize_kernel._tile_config`` and ``_loop_config``), there for sweeps."""
    import megatron_quads.nvfp4.quantize_kernel as kq

    with contextlib.ExitStack() as stack:
        if tile is not None:
            stack.enter_context(mock.patch.object(kq, "_tile_config", lambda rows, block_2d, blocks: tile))
        if loop is not None:
            stack.enter_context(mock.patch.object(kq, "_loop_config", lambda block_2d=False: loop))
        yield


def _tile_name(config: tuple[int, int, int]) -> str:
    return f"tile {config[0]}x{config[1] * 16} ({config[2]} warps)"


def bench_quantize_tiles(bandwidth: float, size: int) -> list[dict]:
    """Quantize (1x16 and 16x16) and fake quant of a size x size bf16 tensor with each tile and
    persistent-loop config (:func:`quantize_config`): the evidence for the defaults."""
    from megatron_quads.nvfp4.quantize_kernel import fake_quant_kernel, quantize_kernel

    x = torch.randn(size, size, device=DEV, dtype=torch.bfloat16)
    amax = x.abs().amax().float()
    n = x.numel()
    q_bytes = n * 2 + n // 2 + n // 16

    def quantize_us(block_2d: bool, **config) -> float:
        with quantize_config(**config):
            return time_graph(lambda: quantize_kernel(x, amax, block_2d=block_2d, validate=False), calls=5)

    rows = []
    for tile in [(1, 128, 4), (2, 64, 4), (4, 16, 4), (8, 16, 4), (16, 8, 4), (16, 16, 4), (32, 16, 4), (16, 32, 8), (64, 16, 8)]:
        with quantize_config(tile=tile):
            tf = time_graph(lambda: fake_quant_kernel(x, amax), calls=5)
        rows.append(row(f"quantize 1x16 {_tile_name(tile)}", quantize_us(False, tile=tile), q_bytes, 0, bandwidth,
                        fake_quant_us=round(tf, 2), fake_quant_frac=round(n * 4 / bandwidth / (tf * 1e-6), 3)))
    for tile in [(16, 8, 4), (16, 16, 4), (16, 32, 4), (16, 16, 8), (32, 16, 4), (16, 64, 8), (16, 8, 2)]:
        rows.append(row(f"quantize 16x16 {_tile_name(tile)}", quantize_us(True, tile=tile), q_bytes, 0, bandwidth))
    for loop in [16, 32, 64, 1 << 20]:
        for block_2d in (False, True):
            programs = "one program a tile" if loop == 1 << 20 else f"{loop} programs/SM"
            rows.append(row(f"quantize {'16x16' if block_2d else '1x16'} default tile, {programs}",
                            quantize_us(block_2d, loop=loop), q_bytes, 0, bandwidth))
    return rows


def _weight(n: int, k: int, experts: int | None = None):
    shape = (n, k) if experts is None else (experts, n, k)
    w = torch.randn(shape, device=DEV, dtype=torch.bfloat16) * 0.02
    amax = w.abs().amax() if experts is None else w.abs().amax(dim=(1, 2)).unsqueeze(1)
    return w, quantize(w, global_amax=amax.float())


L2_COLD_BYTES = 150 << 20
"""Copies of a weight, called in turn, add up to at least this (three times the H200's 50 MB L2) in
the L2-cold timings: a decode step reads each layer's weights once, while replaying one call many times
serves an FP4 weight of up to ~50 MB (8192^2: 37.7 MB) from L2."""


def l2_cold_copies(nbytes: int) -> int:
    """How many copies of an ``nbytes`` operand pass :data:`L2_COLD_BYTES` together."""
    return max(2, -(-L2_COLD_BYTES // nbytes))


def rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """The ``calls`` one after the other, round robin (a CUDA graph of 20 calls captures 20 of them)."""
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()

    return call


def bench_w4a16(bandwidth: float, quick: bool) -> list[dict]:
    """Dense decode GEMMs: the W4A16 linear as dispatched (``kernel=None``) vs cuBLAS BF16 and FP8,
    and the Triton kernel (``kernel="triton"``: ``triton_us``); the dispatched kernel and FP8 also
    L2-cold (``*_l2_cold_us``: weight copies called in turn, :func:`rotating`)."""
    from megatron_quads.kernels.w4a16 import w4a16_linear_into, w4a16_linear_kernel

    rows = []
    shapes = [(4096, 4096), (8192, 8192)] if quick else [(2048, 2048), (4096, 4096), (8192, 8192), (2048, 8192), (8192, 2048)]
    for k, n in shapes:
        w, qw = _weight(n, k)
        w8 = w.to(torch.float8_e4m3fn)
        one = torch.ones((), device=DEV)
        cold_qw, cold_w8 = [qw], [w8]  # as many copies as the FP4 bytes need (more than FP8's), each quantized both ways
        for _ in range(l2_cold_copies(n * k // 2 + n * k // 16) - 1):
            w_copy, qw_copy = _weight(n, k)
            cold_qw.append(qw_copy)
            cold_w8.append(w_copy.to(torch.float8_e4m3fn))
            del w_copy
        for m in (1, 16, 64) if quick else (1, 4, 16, 32, 64):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            x8 = torch.randn(max(m, 16), k, device=DEV).to(torch.float8_e4m3fn)
            out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
            fp4_bytes = n * k // 2 + n * k // 16 + m * k * 2 + m * n * 2
            flops = 2 * m * n * k
            t4 = time_graph(lambda: w4a16_linear_kernel(x, qw))
            t_triton = time_graph(lambda: w4a16_linear_into(x, qw, out, kernel="triton"))
            tb = time_graph(lambda: x @ w.t())
            t8 = time_graph(lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16))
            t4_cold = time_graph(rotating([partial(w4a16_linear_kernel, x, q) for q in cold_qw]))
            t8_cold = time_graph(rotating([partial(torch._scaled_mm, x8, w.t(), one, one, out_dtype=torch.bfloat16)
                                           for w in cold_w8]))
            rows.append(row(f"w4a16 M={m} K={k} N={n}", t4, fp4_bytes, flops, bandwidth, bf16_us=round(tb, 2),
                            fp8_us=round(t8, 2), speedup_vs_fp8=round(t8 / t4, 2), speedup_vs_bf16=round(tb / t4, 2),
                            triton_us=round(t_triton, 2), l2_cold_us=round(t4_cold, 2),
                            fp8_l2_cold_us=round(t8_cold, 2), speedup_vs_fp8_l2_cold=round(t8_cold / t4_cold, 2),
                            frac_of_floor_l2_cold=round(fp4_bytes / bandwidth / (t4_cold * 1e-6), 3)))
        del cold_qw, cold_w8
    return rows


def _config_name(cfg: dict) -> str:
    """A sweep's name for a config over a kernel's defaults."""
    return ",".join(f"{key}={value}" for key, value in cfg.items()) or "default"


def _best_of_sweep(run: Callable[[dict], object], out: torch.Tensor, reference: torch.Tensor,
                   configs: list[dict]) -> tuple[str, float, dict[str, float | str]]:
    """Time ``run(config)`` for each config whose output (in ``out``) agrees with ``reference``:
    ``(best name, its us, every result by name)``; a wrong result or a config that fails is
    reported, not fatal."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    sweep: dict[str, float | str] = {}
    atol = 1e-2 * float(reference.float().abs().max())
    for cfg in configs:
        name = _config_name(cfg)
        try:
            out.fill_(float("nan"))
            run(cfg)
            if not torch.allclose(out.float(), reference.float(), rtol=2**-6, atol=atol):
                sweep[name] = "WRONG"
                continue
            sweep[name] = round(time_graph(lambda cfg=cfg: run(cfg)), 2)
        except (CompilationError, OutOfResources, RuntimeError, ValueError) as err:
            sweep[name] = f"error: {str(err).splitlines()[0][:80]}"
    timed = {name: t for name, t in sweep.items() if isinstance(t, float)}
    best = min(timed, key=timed.get) if timed else "none"
    return best, timed.get(best, float("nan")), sweep


WS_DENSE_CONFIGS = [{}, {"X_WARPS": 1}, {"X_WARPS": 4}, {"SPLIT_K": 3}, {"SPLIT_K": 6}, {"BLOCK_N": 128, "num_warps": 8, "CTAS_PER_SM": 2},
                    {"BLOCK_N": 128, "num_warps": 8, "CTAS_PER_SM": 2, "SPLIT_K": 2}]
"""Configs of the warp-specialized dense kernel's sweep, over its defaults (``w4a16_ws_dense``;
``X_WARPS``: how many warps reorder x inside the kernel)."""

WS_DENSE_SHAPES = [(1, 8192, 8192), (16, 8192, 8192), (32, 8192, 8192), (64, 8192, 8192), (1, 4096, 4096),
                   (16, 4096, 4096), (64, 4096, 4096)]
"""(M, K, N) of the ``w4a16_ws_dense`` section (``--dense-shape`` replaces them)."""


def bench_w4a16_ws_dense(bandwidth: float, shapes: list[tuple[int, int, int]] | None = None) -> list[dict]:
    """The warp-specialized dense kernel (``w4a16_ws_dense``) per decode shape: ``us`` at its
    defaults, the best of :data:`WS_DENSE_CONFIGS` (each checked against the Triton kernel first),
    beside the Triton kernel, cuBLAS FP8 and BF16."""
    from megatron_quads.kernels.w4a16 import w4a16_linear_into
    from megatron_quads.kernels.w4a16_ws_dense import w4a16_ws_linear_into

    rows = []
    for m, k, n in shapes or WS_DENSE_SHAPES:
        w, qw = _weight(n, k)
        w8 = w.to(torch.float8_e4m3fn)
        one = torch.ones((), device=DEV)
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        x8 = torch.randn(max(m, 16), k, device=DEV).to(torch.float8_e4m3fn)
        reference = w4a16_linear_into(x, qw, torch.empty(m, n, device=DEV, dtype=torch.bfloat16), kernel="triton")
        out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
        best, t_best, sweep = _best_of_sweep(lambda cfg: w4a16_ws_linear_into(x, qw, out, cfg), out, reference,
                                             WS_DENSE_CONFIGS)
        t_default = sweep["default"] if isinstance(sweep["default"], float) else float("nan")
        t_triton = time_graph(lambda: w4a16_linear_into(x, qw, out, kernel="triton"))
        tb = time_graph(lambda: x @ w.t())
        t8 = time_graph(lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16))
        fp4_bytes = n * k // 2 + n * k // 16 + m * k * 2 + m * n * 2
        rows.append(row(f"w4a16 ws dense M={m} K={k} N={n}", t_default, fp4_bytes, 2 * m * n * k, bandwidth,
                        best_config=best, best_us=round(t_best, 2), triton_us=round(t_triton, 2), fp8_us=round(t8, 2),
                        bf16_us=round(tb, 2), speedup_vs_fp8=round(t8 / t_default, 2),
                        speedup_vs_triton=round(t_triton / t_default, 2), sweep=sweep))
    return rows


def _routing(tokens: int, experts: int, topk: int) -> torch.Tensor:
    choice = torch.rand(tokens, experts, device=DEV).topk(topk, dim=1).indices.flatten()
    return torch.bincount(choice, minlength=experts)


def _grouped_bytes(active: int, n: int, k: int, x: torch.Tensor) -> int:
    """Bytes a grouped W4A16 GEMM moves: the active experts' FP4 codes and scales, x, the bf16 output."""
    return active * (n * k // 2 + n * k // 16) + x.numel() * 2 + x.shape[0] * n * 2


QWEN3_EXPERT_SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}
"""(N, K) of Qwen3-30B-A3B's expert projections (hidden 2048, expert ffn 768; 128 experts, top-8)."""


def _routed_cases(quick: bool):
    """The grouped sections' cases: ``(projection, BF16 weight as grouped_mm's B [E, K, N], its NVFP4
    stack, tokens, rows per expert, expert offsets, routed x)``, random routing of top-8 of 128."""
    experts, topk = 128, 8
    for proj, (n, k) in QWEN3_EXPERT_SHAPES.items():
        w, qw = _weight(n, k, experts)
        w_t = w.transpose(1, 2)  # [E, K, N] column-major view, what grouped_mm's B expects
        for tokens in (64, 512) if quick else (8, 32, 64, 128, 256, 512):
            counts = _routing(tokens, experts, topk)
            offsets = expert_offsets_from_counts(counts)
            yield proj, w_t, qw, tokens, counts, offsets, torch.randn(tokens * topk, k, device=DEV, dtype=torch.bfloat16)


GROUPED_WEIGHT_TILES = ((64, 128, 4, 4), (64, 128, 4, 3), (128, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 4),
                        (128, 256, 8, 3), (256, 64, 8, 4))
"""(BLOCK_N, BLOCK_K, num_warps, num_stages) timed with each token tile in the ``grouped`` section:
tiles around the grouped kernel's default (``kernels.w4a16.GROUPED_TILES``)."""


def _token_tile_times(x: torch.Tensor, qw, offsets: torch.Tensor) -> dict[str, float]:
    """The Triton grouped kernel with each token tile (``BLOCK_M``), the best of
    :data:`GROUPED_WEIGHT_TILES` for each: the evidence for the default token tile."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from megatron_quads.kernels.w4a16 import grouped_w4a16_into

    out = torch.empty(x.shape[0], qw.shape[1], device=x.device, dtype=x.dtype)
    times = {}
    for block_m in (16, 32, 64):
        tile_times = []
        for bn, bk, warps, stages in GROUPED_WEIGHT_TILES:
            cfg = {"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
            try:
                tile_times.append(time_graph(lambda cfg=cfg: grouped_w4a16_into(x, qw, offsets, out, cfg, kernel="triton")))
            except (CompilationError, OutOfResources):  # as the autotuner does, leave out a tile that does not fit
                continue
        times[f"block_m{block_m}_us"] = round(min(tile_times, default=float("nan")), 2)
    return times


GROUPED_X_MMA_ORDER_CONFIGS = [(128, 4, 4), (128, 4, 3), (256, 8, 4), (64, 4, 3)]
"""(BLOCK_N, num_warps, num_stages) of the Triton grouped kernel timed with x already in its K order
(``x_mma_order``, BLOCK_K 128), each with two token tiles."""


def _x_mma_order_sweep(x: torch.Tensor, ordered_x: torch.Tensor, qw, offsets: torch.Tensor, tokens: int,
                       bf16_us: float) -> dict[str, float | str]:
    """The Triton grouped kernel on x whose rows are already in its K order (``x_mma_order``: x tiles
    go from shared memory to the MMA as loaded), best of :data:`GROUPED_X_MMA_ORDER_CONFIGS`, each
    checked bit for bit against the natural-order kernel with the same config; the default
    tile; the tuned call writing its output in that order too (``y_mma_order``, what
    gate/up does for the down projection); and what putting x in that order costs as a separate copy
    (the routed rows, and the ``tokens`` rows before the MoE gather, which is where
    :class:`~megatron_quads.rollout.grouped_experts.GroupedExperts` does it)."""
    from megatron_quads.kernels.w4a16 import grouped_w4a16_into, mma_k_order_rows

    natural = torch.empty(x.shape[0], qw.shape[1], device=x.device, dtype=x.dtype)  # each config's natural-order output
    out = torch.empty_like(natural)
    times = {}
    for (bn, warps, stages), block_m in itertools.product(GROUPED_X_MMA_ORDER_CONFIGS, (16, 32) if tokens <= 64 else (32, 64)):
        cfg = {"BLOCK_N": bn, "BLOCK_K": 128, "BLOCK_M": block_m, "num_warps": warps, "num_stages": stages}
        grouped_w4a16_into(x, qw, offsets, natural, cfg, kernel="triton")
        grouped_w4a16_into(ordered_x, qw, offsets, out, cfg, x_mma_order=True, kernel="triton")
        if not torch.equal(out, natural):
            raise AssertionError(f"x_mma_order with config {cfg} differs from the natural-order kernel")
        times[f"{bn}x128 m{block_m} w{warps} st{stages}"] = time_graph(
            lambda: grouped_w4a16_into(ordered_x, qw, offsets, out, cfg, x_mma_order=True, kernel="triton"))
    best = min(times, key=times.get)
    hidden = x[:tokens]
    tuned = time_graph(lambda: grouped_w4a16_into(ordered_x, qw, offsets, out, x_mma_order=True, kernel="triton"))
    y_ordered = time_graph(lambda: grouped_w4a16_into(ordered_x, qw, offsets, out, x_mma_order=True, y_mma_order=True,
                                                      kernel="triton"))
    return {"x_mma_order_us": round(times[best], 2), "x_mma_order_config": best, "x_mma_order_tuned_us": round(tuned, 2),
            "x_and_y_mma_order_tuned_us": round(y_ordered, 2),
            "x_mma_order_speedup_vs_bf16": round(bf16_us / times[best], 2),
            "order_routed_rows_us": round(time_graph(lambda: mma_k_order_rows(x, 128)), 2),
            "order_tokens_us": round(time_graph(lambda: mma_k_order_rows(hidden, 128)), 2)}


def bench_grouped(bandwidth: float, quick: bool) -> list[dict]:
    """The Triton grouped W4A16 kernel (``kernel="triton"``, its default tile) at Qwen3-30B-A3B expert shapes
    vs BF16 ``torch._grouped_mm``, with each token tile, and on x in its K order."""
    from megatron_quads.kernels.w4a16 import X_ORDER_BLOCK_K, grouped_w4a16_into, mma_k_order_rows

    rows = []
    for proj, w_t, qw, tokens, counts, offsets, x in _routed_cases(quick):
        n, k = qw.shape[1:]
        active = int((counts > 0).sum())
        fp4_bytes = _grouped_bytes(active, n, k, x)
        ordered_x = mma_k_order_rows(x, X_ORDER_BLOCK_K)  # x in the kernel's K order
        out = torch.empty(x.shape[0], n, device=DEV, dtype=torch.bfloat16)
        t4 = time_graph(lambda: grouped_w4a16_into(x, qw, offsets, out, kernel="triton"))
        tb = time_graph(lambda: torch._grouped_mm(x, w_t, offs=offsets[1:].contiguous()))
        rows.append(row(f"grouped w4a16 {proj} tokens={tokens} (rows {x.shape[0]}, {active} experts)", t4, fp4_bytes,
                        2 * x.shape[0] * n * k, bandwidth, bf16_grouped_us=round(tb, 2), speedup_vs_bf16=round(tb / t4, 2),
                        **_token_tile_times(x, qw, offsets),
                        **_x_mma_order_sweep(x, ordered_x, qw, offsets, tokens, tb)))
    return rows


WS_CONFIGS = [
    {},  # the defaults (w4a16_ws.default_config: BLOCK_K 256, with the scale bytes in the ring, where 256 divides K; and the DYNAMIC schedule)
    {"DYNAMIC": 0},
    {"DYNAMIC": 1},
    {"LOADER_REGS": 24},
    {"BLOCK_N": 64, "num_warps": 4, "STAGES": 2, "CTAS_PER_SM": 2, "maxnreg": 128},
    {"BLOCK_N": 256, "num_warps": 16, "STAGES": 2, "CTAS_PER_SM": 1, "maxnreg": 0},
    {"BLOCK_K": 128, "STAGES": 3},
    {"BLOCK_K": 128, "STAGES": 4, "CTAS_PER_SM": 1, "maxnreg": 0},
    {"BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 128, "STAGES": 3, "CTAS_PER_SM": 3, "maxnreg": 80},
    {"BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 128, "STAGES": 2, "CTAS_PER_SM": 4, "maxnreg": 64},
]
"""Configs of the warp-specialized grouped kernel (``w4a16_ws``) timed by the ``grouped_ws`` section,
over its defaults (:func:`~megatron_quads.kernels.w4a16_ws.default_config`)."""


def bench_grouped_ws(bandwidth: float, quick: bool) -> list[dict]:
    """The warp-specialized Gluon grouped kernel at Qwen3-30B-A3B expert shapes, x in its K order:
    ``us`` at its defaults, the best of :data:`WS_CONFIGS`, and the defaults writing y in that order
    too, each config checked against the Triton kernel first; against the Triton kernel on the same
    x (``kernel="triton"``, its default tile) and BF16 ``torch._grouped_mm``."""
    from triton.errors import TritonError

    from megatron_quads.kernels.w4a16 import X_ORDER_BLOCK_K, grouped_w4a16_into, mma_k_order_rows
    from megatron_quads.kernels.w4a16_ws import grouped_w4a16_ws_into

    rows = []
    for proj, w_t, qw, tokens, counts, offsets, x in _routed_cases(quick):
        n, k = qw.shape[1:]
        ordered_x = mma_k_order_rows(x, X_ORDER_BLOCK_K)
        reference = torch.empty(x.shape[0], n, device=DEV, dtype=torch.bfloat16)
        grouped_w4a16_into(ordered_x, qw, offsets, reference, x_mma_order=True, kernel="triton")
        out = torch.empty_like(reference)
        t_triton = time_graph(lambda: grouped_w4a16_into(ordered_x, qw, offsets, out, x_mma_order=True, kernel="triton"))
        expected = reference.float()
        atol = 1e-3 * float(expected.abs().max())
        times, same_bits, wrong = {}, {}, {}
        for cfg in WS_CONFIGS:
            name = _config_name(cfg)
            out.fill_(float("nan"))
            try:
                grouped_w4a16_ws_into(ordered_x, qw, offsets, out, cfg)
            except (ValueError, TritonError) as err:  # a config that does not build here (registers, shared memory)
                wrong[name] = {"error": str(err).strip().splitlines()[-1][:160]}
                continue
            close = torch.isclose(out.float(), expected, rtol=2**-7, atol=atol)
            if not close.all():  # recorded and not timed (a wrong kernel's time means nothing)
                wrong[name] = {"elements": int((~close).sum()), "rows": int((~close).any(1).sum())}
                continue
            same_bits[name] = bool(torch.equal(out, reference))
            times[name] = time_graph(lambda cfg=cfg: grouped_w4a16_ws_into(ordered_x, qw, offsets, out, cfg))
        if "default" not in times:
            raise RuntimeError(f"the warp-specialized grouped kernel did not run at its defaults here ({proj}, "
                               f"{tokens} tokens): {wrong.get('default')}")
        best = min(times, key=times.get)
        t_default = times["default"]
        t_y_order = time_graph(lambda: grouped_w4a16_ws_into(ordered_x, qw, offsets, out, y_mma_order=True))
        tb = time_graph(lambda: torch._grouped_mm(x, w_t, offs=offsets[1:].contiguous()))
        active = int((counts > 0).sum())
        fp4_bytes = _grouped_bytes(active, n, k, x)
        rows.append(row(f"grouped w4a16 ws {proj} tokens={tokens} (rows {x.shape[0]}, {active} experts)", t_default,
                        fp4_bytes, 2 * x.shape[0] * n * k, bandwidth, best_config=best, best_us=round(times[best], 2),
                        triton_x_mma_order_us=round(t_triton, 2), y_mma_order_us=round(t_y_order, 2),
                        bf16_grouped_us=round(tb, 2), speedup_vs_bf16=round(tb / t_default, 2),
                        speedup_vs_triton=round(t_triton / t_default, 2), same_bits_as_triton=same_bits, wrong=wrong,
                        sweep={name: round(t, 2) for name, t in times.items()}))
    return rows


def _moe_forward(layer, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, x_order: bool,
                 down_order: bool, kernel: str | None) -> torch.Tensor:
    """The forward of a W4A16 ``GroupedExperts`` layer spelled out with its choices named: the tokens'
    rows in the kernel's K order before the gather (``x_order``), gate/up writing the down input in
    it (``down_order``), and the grouped GEMMs' ``kernel``. Routing, gather, gate/up,
    ``silu(gate) * up``, down, combine, as the layer runs them."""
    from megatron_quads.kernels.w4a16 import X_ORDER_BLOCK_K, grouped_w4a16_into, mma_k_order_rows
    from megatron_quads.rollout.grouped import combine_routed_rows, route_by_expert

    top_k = top_k_index.shape[-1]
    order, offsets = route_by_expert(top_k_index.reshape(-1), layer.num_experts)
    source = mma_k_order_rows(x, X_ORDER_BLOCK_K) if x_order else x
    routed = source[order // top_k]
    gate_up = torch.empty(routed.shape[0], layer.gate_up.weight.shape[1], device=x.device, dtype=x.dtype)
    grouped_w4a16_into(routed, layer.gate_up.weight, offsets, gate_up, x_mma_order=x_order, y_mma_order=down_order,
                       kernel=kernel)
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.empty(routed.shape[0], layer.down.weight.shape[1], device=x.device, dtype=x.dtype)
    grouped_w4a16_into(torch.nn.functional.silu(gate) * up, layer.down.weight, offsets, y, x_mma_order=down_order,
                       kernel=kernel)
    return combine_routed_rows(y, order, top_k_weights.reshape(-1, top_k), x.dtype)


def bench_moe_layer(bandwidth: float, quick: bool) -> list[dict]:
    """The engine's grouped MoE layer (``GroupedExperts``, ``w4a16``) at Qwen3-30B-A3B expert
    shapes, routing and gather included, with the kernels' K orders where the layer takes them,
    against the same forward (:func:`_moe_forward`, checked bit for bit against the layer) with x in
    natural order throughout and with the Triton grouped kernel (``kernel="triton"``)."""
    from megatron_quads.precision import Precision
    from megatron_quads.rollout.grouped_experts import GroupedExperts, GroupedProjection

    experts, topk, hidden, ffn, rows = 128, 8, 2048, 768, []
    layer = GroupedExperts(GroupedProjection(Precision("w4a16"), _weight(2 * ffn, hidden, experts)[1]),
                           GroupedProjection(Precision("w4a16"), _weight(hidden, ffn, experts)[1]))
    silu = torch.nn.functional.silu
    from megatron_quads.kernels.dispatch import X_ORDER_MIN_ROWS_PER_EXPERT

    for tokens in (64, 512) if quick else (8, 32, 64, 128, 256, 512):
        x = torch.randn(tokens, hidden, device=DEV, dtype=torch.bfloat16)
        top_k_index = torch.rand(tokens, experts, device=DEV).topk(topk, dim=1).indices
        top_k_weights = torch.rand(tokens, topk, device=DEV)
        routed = tokens * topk
        x_order = layer.gate_up.input_order(x, routed / experts) is not None
        down_order = layer._down_input_in_kernel_order(x, routed / experts)
        spelled_out = partial(_moe_forward, layer, x, top_k_index, top_k_weights)
        if not torch.equal(spelled_out(x_order, down_order, None), layer(x, top_k_index, top_k_weights, silu)):
            raise AssertionError("_moe_forward no longer computes what GroupedExperts does: update it to the layer")
        ordered = time_graph(lambda: layer(x, top_k_index, top_k_weights, silu))
        natural = time_graph(lambda: spelled_out(False, False, None))
        triton_only = time_graph(lambda: spelled_out(x_order, down_order, "triton"))
        # K order forced whatever the rows per expert: what the layer would cost below its threshold
        forced_down = layer._down_input_in_kernel_order(x, X_ORDER_MIN_ROWS_PER_EXPERT)
        kernel_order = time_graph(lambda: spelled_out(True, forced_down, None))
        active = int(torch.unique(top_k_index).numel())
        # the active experts' FP4 weights and scales; bf16 activations of both GEMMs: gate/up reads
        # hidden and writes 2 ffn values a routed row, down reads ffn and writes hidden
        nbytes = active * 3 * hidden * ffn * (1 / 2 + 1 / 16) + routed * (2 * hidden + 3 * ffn) * 2
        rows.append(row(f"moe layer w4a16 tokens={tokens} (gate/up + down, {active} experts)", ordered, nbytes,
                        2 * routed * 3 * hidden * ffn, bandwidth, natural_order_us=round(natural, 2),
                        triton_grouped_us=round(triton_only, 2), kernel_order_gain=round(natural / ordered - 1, 3),
                        kernel_order_forced_us=round(kernel_order, 2),
                        down_in_kernel_order=down_order))
    return rows


def _stacked_rac_residual(qw, channels: torch.Tensor, s: int):
    """The RAC residual weight ``[E, N, S]`` of stacked ``qw`` at each expert's channel set."""
    experts, n = qw.shape[0], qw.shape[1]
    parts = [reblock_columns(expert_weight(qw, e), channels[e]) for e in range(experts)]
    return type(qw)(codes=torch.stack([p.codes for p in parts]), scales=torch.stack([p.scales for p in parts]),
                    weight_scale_2=qw.weight_scale_2, shape=torch.Size((experts, n, s)), dtype=qw.dtype)


def bench_rac(bandwidth: float, quick: bool) -> list[dict]:
    """W4A4 + RAC against plain W4A4 (ratio 0), dense and grouped, per residual ratio: ``us`` the
    default call (the W4A16 kernels over the prologue's block values; grouped tails prepared as the
    engine prepares them, ``prepare_rac_tail``), ``rac_gemm_us`` the RAC GEMM (an explicit
    ``GemmConfig``, the tiles ``gemm_config`` gives)."""
    from megatron_quads.kernels.w4a4 import gemm_config, grouped_rac_kernel, prepare_rac_tail, rac_linear_kernel

    rows = []
    for m, k, n in ((16, 4096, 4096), (2048, 4096, 4096)):
        _, qw = _weight(n, k)
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        base = None
        for ratio in (0.0, 0.125, 0.25, 0.5, 1.0):
            channels = select_channels(torch.rand(k, device=DEV), ratio).to(DEV)
            residual = reblock_columns(qw, channels) if channels.numel() else None
            t = time_graph(lambda: rac_linear_kernel(x, qw, channels, residual), calls=10)
            t_gemm = time_graph(lambda: rac_linear_kernel(x, qw, channels, residual, config=gemm_config(m)), calls=10)
            base = base or t
            s = num_residual_channels(k, ratio)
            nbytes = (n * (k + s)) // 2 + n * (k + s) // 16 + m * k * 2 + m * n * 2
            rows.append(row(f"w4a4+rac M={m} K={k} N={n} ratio={ratio}", t, nbytes, 2 * m * n * (k + s), bandwidth,
                            overhead_vs_w4a4=round(t / base - 1, 3), rac_gemm_us=round(t_gemm, 2)))
    experts, topk, k, n = 128, 8, 2048, 1536
    _, qw = _weight(n, k, experts)
    for tokens, ratios in ((256, (0.0, 0.25, 0.5)), (4096, (0.0, 0.25))):  # decode; prefill (256 rows per expert)
        counts = _routing(tokens, experts, topk)
        offsets = expert_offsets_from_counts(counts)
        x = torch.randn(tokens * topk, k, device=DEV, dtype=torch.bfloat16)
        tiles = gemm_config(-(-x.shape[0] // experts))
        base = None
        for ratio in ratios:
            s = num_residual_channels(k, ratio)
            if s:
                channels = torch.stack([select_channels(torch.rand(k, device=DEV), ratio) for _ in range(experts)]).to(DEV)
                channels, residual = prepare_rac_tail(channels, _stacked_rac_residual(qw, channels, s), k, x.device)
            else:
                channels = residual = None
            t = time_graph(lambda: grouped_rac_kernel(x, qw, offsets, channels, residual), calls=10)
            t_gemm = time_graph(lambda: grouped_rac_kernel(x, qw, offsets, channels, residual, config=tiles), calls=10)
            base = base or t
            active = int((counts > 0).sum())  # experts whose weights are read, as in bench_grouped
            nbytes = active * ((n * (k + s)) // 2 + n * (k + s) // 16) + x.shape[0] * (k * 2 + n * 2)
            rows.append(row(f"grouped w4a4+rac gate_up tokens={tokens} ratio={ratio}", t, nbytes,
                            2 * x.shape[0] * n * (k + s), bandwidth, overhead_vs_w4a4=round(t / base - 1, 3),
                            rac_gemm_us=round(t_gemm, 2)))
    return rows


def bench_rac_ws(bandwidth: float, quick: bool) -> list[dict]:
    """Grouped W4A4 + RAC at Qwen3-30B-A3B gate/up and down (the engine's ``quads`` / ``w4a4`` MoE
    GEMMs): the default call on the tail the engine prepares (``prepare_rac_tail``: a tail that is
    not whole ring steps widened to them where the reduction grows by at most
    ``TAIL_PAD_MAX_GROWTH``; its width is ``tail_width``), the prologue's block values in the K order
    and the GEMM on the warp-specialized kernel, against the same product on the chosen tail and
    natural-order block values with the Triton grouped kernel (``kernel="triton"``), checked to agree
    within the fp32 bound before either is timed."""
    from megatron_quads.kernels.w4a16 import grouped_w4a16_into
    from megatron_quads.kernels.w4a4 import (
        activation_block_values_kernel,
        grouped_rac_kernel,
        prepare_rac_tail,
    )

    experts, topk = 128, 8
    rows = []
    for (proj, k, n), tokens in itertools.product((("gate_up", 2048, 1536), ("down", 768, 2048)), (64, 512)):
        _, qw = _weight(n, k, experts)
        counts = _routing(tokens, experts, topk)
        offsets = expert_offsets_from_counts(counts)
        x = torch.randn(tokens * topk, k, device=DEV, dtype=torch.bfloat16)
        out = torch.empty(x.shape[0], n, device=DEV, dtype=torch.bfloat16)
        for ratio in (0.0, 0.125, 0.25):
            s = num_residual_channels(k, ratio)
            channels = (torch.stack([select_channels(torch.rand(k, device=DEV), ratio) for _ in range(experts)]).to(DEV)
                        if s else None)
            residual = _stacked_rac_residual(qw, channels, s) if s else None
            prepared = prepare_rac_tail(channels, residual, k, x.device) if s else (None, None)

            def default(prepared=prepared):
                return grouped_rac_kernel(x, qw, offsets, *prepared)

            def triton_natural(channels=channels, residual=residual):
                values, decode = activation_block_values_kernel(x, channels, expert_offsets=offsets)
                return grouped_w4a16_into(values, qw, offsets, out, tail=residual, row_scale=decode, kernel="triton")

            reference = triton_natural().float()
            t_triton = time_graph(triton_natural)
            agrees = bool(torch.allclose(default().float(), reference, rtol=2**-7,
                                         atol=1e-3 * float(reference.abs().max())))
            t_ws = time_graph(default) if agrees else float("nan")
            active = int((counts > 0).sum())
            nbytes = active * ((n * (k + s)) // 2 + n * (k + s) // 16) + x.shape[0] * (k * 2 + n * 2)
            rows.append(row(f"grouped w4a4+rac {proj} tokens={tokens} ratio={ratio} (S {s})", t_ws, nbytes,
                            2 * x.shape[0] * n * (k + s), bandwidth, triton_natural_us=round(t_triton, 2),
                            speedup_vs_triton=round(t_triton / t_ws, 2), agrees_with_triton=agrees,
                            tail_width=prepared[0].shape[1] if s else 0))
    return rows


SECTION_ORDER = ["quantize", "quantize_tiles", "w4a16", "w4a16_ws_dense", "grouped", "grouped_ws", "moe_layer", "rac", "rac_ws"]
"""Every section, in the order of the Markdown view."""

DEFAULT_SECTIONS = ["quantize", "w4a16", "grouped", "grouped_ws", "rac"]
"""The sections a run without ``--only`` measures."""


def markdown_view(records: dict[str, dict]) -> str:
    """Each section's table (its record in ``kernels_gpu.json``) under the date, device, command and
    copy bandwidth of the run that measured it (runs with ``--only`` refresh some sections)."""
    lines = ["# NVFP4 kernels on the GPU: the newest run of each section", "",
             ("From `kernels_gpu.json` (`python benchmarks/bench_kernels.py --render` rewrites this view). `floor_us`: "
              "bytes / the copy bandwidth measured in the same run; `frac_of_floor`: floor_us / us. GEMMs timed by "
              "CUDA-graph replay; config sweeps stay in the JSON."), ""]
    order = {name: i for i, name in enumerate(SECTION_ORDER)}
    for name in sorted(records, key=lambda n: (order.get(n, len(order)), n)):
        record = records[name]
        rows = record["rows"]
        if not rows:
            continue
        keys = [key for key, value in rows[0].items() if not isinstance(value, dict)]  # sweeps stay in the JSON
        lines += [f"## {name}", "", (f"{record['device']}, {record['date']}: `{record['command']}`; device-to-device copy "
                  f"{record['copy_GBps']} GB/s; timed eagerly (graph capture failed): {record['eager_timed'] or 'none'}."), "",
                  "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r.get(k_, "")) for k_ in keys) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def _shape_arg(text: str) -> tuple[int, int, int]:
    """``"M,K,N"`` to a shape (argparse type)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected M,K,N (three positive integers), got {text!r}")
    return tuple(int(p) for p in parts)


def main() -> None:
    """The chosen sections, one record each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--only", nargs="*", default=DEFAULT_SECTIONS, choices=SECTION_ORDER, metavar="SECTION",
                        help=f"sections to run (default: {' '.join(DEFAULT_SECTIONS)}; also: "
                             f"{' '.join(s for s in SECTION_ORDER if s not in DEFAULT_SECTIONS)})")
    parser.add_argument("--dense-shape", action="append", type=_shape_arg, default=None, metavar="M,K,N",
                        help="a shape of the w4a16_ws_dense section instead of its default list (repeatable)")
    parser.add_argument("--render", action="store_true", help="only rewrite kernels_gpu.md from kernels_gpu.json (no GPU)")
    args = parser.parse_args()
    out = Path(__file__).parent / "results" / "kernels_gpu.json"
    if args.render:
        write_text_atomic(out.with_suffix(".md"), markdown_view(load_records(out)))
        return
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    sections = {"quantize": lambda: bench_quantize(bandwidth, 8192),
                "quantize_tiles": lambda: bench_quantize_tiles(bandwidth, 8192),
                "w4a16": lambda: bench_w4a16(bandwidth, args.quick),
                "w4a16_ws_dense": lambda: bench_w4a16_ws_dense(bandwidth, shapes=args.dense_shape),
                "grouped": lambda: bench_grouped(bandwidth, args.quick),
                "grouped_ws": lambda: bench_grouped_ws(bandwidth, args.quick),
                "moe_layer": lambda: bench_moe_layer(bandwidth, args.quick),
                "rac": lambda: bench_rac(bandwidth, args.quick),
                "rac_ws": lambda: bench_rac_ws(bandwidth, args.quick)}
    command = ("python benchmarks/bench_kernels.py" + (" --quick" if args.quick else "")
               + (f" --only {' '.join(args.only)}" if args.only != DEFAULT_SECTIONS else "")
               + "".join(f" --dense-shape {','.join(map(str, shape))}" for shape in args.dense_shape or []))
    device, records = torch.cuda.get_device_name(), load_records(out)
    for name in args.only:
        EAGER_TIMED.clear()
        rows = sections[name]()
        for r in rows:
            print(r, flush=True)
        record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": device,
                  "command": command, "copy_GBps": round(bandwidth / 1e9, 1), "eager_timed": sorted(EAGER_TIMED),
                  "rows": rows}
        records = save_record(out, name, record, out.with_suffix(".md"), markdown_view)  # each section as it ends
    print(markdown_view(records))


if __name__ == "__main__":
    main()
