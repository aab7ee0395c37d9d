"""NVFP4 Triton kernels on the GPU, side by side with BF16 and FP8 in one run.

    python benchmarks/bench_kernels.py [--quick]

Cases (each row: time, bytes moved, FLOPs, and the fraction of the limit reached):
1. Quantize (1x16 given amax, 1x16 with the amax pass, 16x16, fake quant) of an 8192 x 8192 bf16
   tensor: GB/s against the device-to-device copy bandwidth measured in the same run (target >= 70%).
2. W4A16 linear at decode shapes (M = 1..64; K, N = 2048..8192) against BF16 ``torch.matmul`` and
   FP8 ``torch._scaled_mm`` (M padded to 16 for cuBLAS FP8), all timed by CUDA-graph replay; the FP4
   byte floor is (packed weights + scales + activations + output) / copy bandwidth. Targets at
   K, N >= 4096, M <= 16: >= 1.6x faster than FP8 and >= 75% of the byte floor; faster than FP8 to M = 64.
3. Grouped MoE W4A16 at Qwen3-30B-A3B expert shapes (128 experts, hidden 2048, expert ffn 768, top-8;
   gate+up N = 1536 and down) for 64..512 decode tokens against BF16 ``torch._grouped_mm``
   (target >= 2.5x faster): the Triton kernel (``grouped``) and the warp-specialized Gluon kernel the
   engine runs for x in its K order (``grouped_ws``, each config checked against the Triton kernel).
4. W4A4 + RAC: the cost of the residual channels against plain (emulated) W4A4 per ratio; no target.
5. (extra, ``--only moe_layer``) the engine's grouped MoE layer, routing to combine, graph-replayed.
6. (extra, ``--only rac_ws``) grouped W4A4 + RAC gate/up with its GEMM on the warp-specialized kernel
   (the default on sm_90 where the tail fits) against the Triton kernel on natural-order values.
Results: benchmarks/results/kernels_gpu.json (the newest record of each section) and kernels_gpu.md.
"""

# ruff: noqa: B023 -- every lambda is timed (and its graph replayed) before the loop moves on
from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import statistics
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from unittest import mock

import torch
from results_io import load_records, save_record, write_text_atomic

from megatron_quads.nvfp4 import quantize
from megatron_quads.rollout.grouped import expert_offsets_from_counts, expert_weight
from megatron_quads.rollout.rac import (
    num_residual_channels,
    reblock_columns,
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


def bench_quantize_tiles(bandwidth: float, size: int) -> list[dict]:
    """Quantize (1x16 and 16x16) / fake quant of a size x size bf16 tensor with each tile and loop config (the defaults' evidence)."""
    import megatron_quads.nvfp4.quantize_kernel as kq

    x = torch.randn(size, size, device=DEV, dtype=torch.bfloat16)
    amax = x.abs().amax().float()
    n = x.numel()
    q_bytes = n * 2 + n // 2 + n // 16
    rows = []
    for config in [(1, 128, 4), (2, 64, 4), (4, 16, 4), (8, 16, 4), (16, 8, 4), (16, 16, 4), (32, 16, 4), (16, 32, 8), (64, 16, 8)]:
        with mock.patch.object(kq, "_tile_config", lambda rows, block_2d, blocks, config=config: config):
            tq = time_graph(lambda: kq.quantize_kernel(x, amax, validate=False), calls=5)
            tf = time_graph(lambda: kq.fake_quant_kernel(x, amax), calls=5)
        rows.append(row(f"quantize 1x16 tile {config[0]}x{config[1] * 16} ({config[2]} warps)", tq, q_bytes, 0, bandwidth,
                        fake_quant_us=round(tf, 2), fake_quant_frac=round(n * 4 / bandwidth / (tf * 1e-6), 3)))
    for config in [(16, 8, 4), (16, 16, 4), (16, 32, 4), (16, 16, 8), (32, 16, 4), (16, 64, 8)]:
        with mock.patch.object(kq, "_tile_config", lambda rows, block_2d, blocks, config=config: config):
            tq = time_graph(lambda: kq.quantize_kernel(x, amax, block_2d=True, validate=False), calls=5)
        rows.append(row(f"quantize 16x16 tile {config[0]}x{config[1] * 16} ({config[2]} warps)", tq, q_bytes, 0, bandwidth))
    return (rows + _direct_store_rows(x, amax, q_bytes, bandwidth) + _tile_scale_rows(x, amax, q_bytes, bandwidth)
            + _loop_rows(x, amax, q_bytes, bandwidth))


def _tile_scale_rows(x: torch.Tensor, amax: torch.Tensor, q_bytes: int, bandwidth: float) -> list[dict]:
    """16x16 quantize with each tile's scale computed once (``quantize._tile_scales_enabled``, the default
    where a tile's rows share their amax) beside once per row, on the default tile and two others."""
    import megatron_quads.nvfp4.quantize_kernel as kq

    rows = []
    for config in [None, (16, 16, 4), (16, 16, 2)]:
        tile = mock.patch.object(kq, "_tile_config", lambda rows, block_2d, blocks, config=config: config) if config \
            else contextlib.nullcontext()
        times = {}
        for once in (False, True):
            with tile, mock.patch.object(kq, "_tile_scales_enabled", lambda once=once: once):
                times[once] = time_graph(lambda: kq.quantize_kernel(x, amax, block_2d=True, validate=False), calls=5)
        name = "default tile" if config is None else f"tile {config[0]}x{config[1] * 16} ({config[2]} warps)"
        rows.append(row(f"quantize 16x16 {name}, scales once a tile", times[True], q_bytes, 0, bandwidth,
                        scales_per_row_us=round(times[False], 2)))
    return rows


def _direct_store_rows(x: torch.Tensor, amax: torch.Tensor, q_bytes: int, bandwidth: float) -> list[dict]:
    """16-row tiles (1x16 and 16x16) with the PTX codes and direct stores (``quantize._fast_max_rows``),
    each beside Triton's arithmetic and stores in the same run."""
    import megatron_quads.nvfp4.quantize_kernel as kq

    rows = []
    for block_2d, config in [(False, (16, 8, 4)), (False, (16, 16, 4)), (True, (16, 8, 4)), (True, (16, 16, 4)),
                             (True, (16, 32, 4)), (True, (16, 16, 8)), (True, (16, 8, 2))]:
        times = {}
        for fast_rows in (0, 16):
            with mock.patch.object(kq, "_tile_config", lambda rows, block_2d, blocks, config=config: config), \
                    mock.patch.object(kq, "_fast_max_rows", lambda fast_rows=fast_rows: fast_rows):
                times[fast_rows] = time_graph(lambda: kq.quantize_kernel(x, amax, block_2d=block_2d, validate=False), calls=5)
        name = f"quantize {'16x16' if block_2d else '1x16'} tile {config[0]}x{config[1] * 16} ({config[2]} warps), direct stores"
        rows.append(row(name, times[16], q_bytes, 0, bandwidth, triton_stores_us=round(times[0], 2)))
    return rows


def _loop_rows(x: torch.Tensor, amax: torch.Tensor, q_bytes: int, bandwidth: float) -> list[dict]:
    """Quantize with each persistent-loop config (``quantize._loop_config``), 1x16 and 16x16 default tiles."""
    import megatron_quads.nvfp4.quantize_kernel as kq

    rows = []
    for loop in [(16, 0), (32, 0), (16, 1), (32, 1), (64, 1), (1 << 20, 0)]:
        with mock.patch.object(kq, "_loop_config", lambda block_2d=False, loop=loop: loop):
            tq = time_graph(lambda: kq.quantize_kernel(x, amax, validate=False), calls=5)
            t2 = time_graph(lambda: kq.quantize_kernel(x, amax, block_2d=True, validate=False), calls=5)
        rows.append(row(f"quantize 1x16 default tile, {loop[0]} programs/SM, prefetch={loop[1]}", tq, q_bytes, 0, bandwidth))
        rows.append(row(f"quantize 16x16 default tile, {loop[0]} programs/SM, prefetch={loop[1]}", t2, q_bytes, 0, bandwidth))
    return rows + _k_major_rows(x, amax, q_bytes, bandwidth)


def _k_major_rows(x: torch.Tensor, amax: torch.Tensor, q_bytes: int, bandwidth: float) -> list[dict]:
    """Quantize with the K-major program order (``quantize._k_major``) on the tiles where the default
    order runs down many rows of a narrow column slice, each beside the default order in the same run."""
    import megatron_quads.nvfp4.quantize_kernel as kq

    rows = []
    for block_2d, config in [(False, (1, 128, 4)), (False, (4, 16, 4)), (False, (16, 16, 4)), (True, (16, 16, 4)),
                             (True, (16, 8, 4))]:
        times = {}
        for k_major in (False, True):
            with mock.patch.object(kq, "_tile_config", lambda rows, block_2d, blocks, config=config: config), \
                    mock.patch.object(kq, "_k_major", lambda block_2d=False, k_major=k_major: k_major):
                times[k_major] = time_graph(lambda: kq.quantize_kernel(x, amax, block_2d=block_2d, validate=False), calls=5)
        name = f"quantize {'16x16' if block_2d else '1x16'} tile {config[0]}x{config[1] * 16} ({config[2]} warps), K-major"
        rows.append(row(name, times[True], q_bytes, 0, bandwidth, default_order_us=round(times[False], 2)))
    return rows


def _weight(n: int, k: int, experts: int | None = None):
    shape = (n, k) if experts is None else (experts, n, k)
    w = torch.randn(shape, device=DEV, dtype=torch.bfloat16) * 0.02
    amax = w.abs().amax() if experts is None else w.abs().amax(dim=(1, 2)).unsqueeze(1)
    return w, quantize(w, global_amax=amax.float())


L2_COLD_BYTES = 150 << 20
"""Rotated copies of a weight add up to at least this (three times the H200's 50 MB L2) in the
L2-cold timings: a decode step reads each layer's weights once, while replaying one call many times
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
    """Dense decode GEMMs: the dispatched W4A16 kernel (the warp-specialized one on sm_90 up to
    ``WS_DENSE_MAX_M`` rows) vs cuBLAS BF16 and FP8, and the Triton kernel (``triton_us``); the
    dispatched kernel and FP8 also L2-cold (``*_l2_cold_us``: weight copies rotated)."""
    import megatron_quads.kernels.w4a16 as kw
    from megatron_quads.kernels.w4a16 import w4a16_linear_kernel

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
            fp4_bytes = n * k // 2 + n * k // 16 + m * k * 2 + m * n * 2
            flops = 2 * m * n * k
            t4 = time_graph(lambda: w4a16_linear_kernel(x, qw))  # the dispatched kernel
            with mock.patch.object(kw, "_WS_DENSE_DISPATCH", False):
                t_triton = time_graph(lambda: w4a16_linear_kernel(x, qw))
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


MMA_CONFIGS = [(bn, bk, warps, 1, 0) for bn, bk, warps in ((32, 128, 1), (64, 128, 1), (64, 128, 2), (128, 128, 4))] + [
    (bn, bk, warps, 1, stages) for bn, bk, warps in ((64, 128, 1), (128, 128, 1), (128, 64, 1), (128, 128, 2),
                                                     (256, 128, 2), (128, 128, 4)) for stages in (4, 6)]
"""(BLOCK_N, BLOCK_K, num_warps, PREFETCH, STAGES) of the Gluon kernels' sweep: weights in registers
(STAGES 0) or through a shared-memory ring, which also lets a warp take 128 weight rows a step (the
register path spills there, offline sm_90) so each x load serves twice the weights. PREFETCH 2 and
3-stage rings (slower than PREFETCH 1 / 4 stages at every shape of the 2026-11-30T05:57 and 06:08
runs) are left out."""


MMA_X_SLICE_CONFIGS = [(64, 128, 1, 255), (64, 128, 2, 0), (128, 128, 2, 0), (128, 128, 4, 128), (256, 128, 4, 0),
                       (256, 128, 8, 128), (512, 128, 8, 0)]
"""(BLOCK_N, BLOCK_K, num_warps, maxnreg or 0) of the dense kernel's ``X_SMEM`` path (x copied into
shared memory once a program, its warps sharing it; 32 or 64 weight rows a warp in registers;
``maxnreg`` 128 lets 16 warps share an SM). Left out after the 2026-11-30T07:47 run and a follow-up
sweep: PREFETCH 2 (4-5% slower at every shape) and BLOCK_K 64 (slower everywhere)."""


def _mma_name(bn: int, bk: int, warps: int, prefetch: int, stages: int) -> str:
    return f"{bn}x{bk} w{warps} p{prefetch}" + (f" st{stages}" if stages else "")


def _mma_sweep(k: int, staged: bool = True) -> dict[str, dict[str, int]]:
    """Named dense configs for a K (``xs``: x through shared memory; ``staged=False`` leaves out the
    weight-ring configs): every split that leaves each slice a K step; 1-warp configs with 255
    registers (ptxas caps them at 168 otherwise and spills; within 3% when both were timed)."""
    splits = (1, 2, 4, 8, 16, 32)
    registers = {_mma_name(bn, bk, warps, prefetch, stages) + f" s{split}" + (" r255" if warps == 1 else ""):
                 {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps, "PREFETCH": prefetch,
                  "STAGES": stages, **({"maxnreg": 255} if warps == 1 else {})}
                 for bn, bk, warps, prefetch, stages in MMA_CONFIGS if staged or not stages
                 for split in splits if k // bk >= split}
    x_slice = {_mma_name(bn, bk, warps, 1, 0) + f" xs s{split}" + (f" r{maxnreg}" if maxnreg else ""):
               {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps, "PREFETCH": 1, "STAGES": 0,
                "X_SMEM": 1, **({"maxnreg": maxnreg} if maxnreg else {})}
               for bn, bk, warps, maxnreg in MMA_X_SLICE_CONFIGS for split in splits if k // bk >= split}
    return registers | x_slice


def _best_of_sweep(run: Callable[[dict], object], out: torch.Tensor, reference: torch.Tensor,
                   configs: dict[str, dict]) -> tuple[str, float, dict[str, float | str]]:
    """Time ``run(config)`` for each named config whose output (in ``out``) agrees with ``reference``:
    ``(best name, its us, every result)``; a wrong result or a config that fails is reported, not fatal."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    sweep: dict[str, float | str] = {}
    atol = 1e-2 * float(reference.float().abs().max())
    for name, cfg in configs.items():
        try:
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


DENSE_DECODE_SHAPES = [(16, 8192, 8192), (16, 4096, 4096), (64, 8192, 8192), (1, 8192, 8192), (64, 4096, 4096)]
"""(M, K, N) of the Gluon decode kernels' dense rows; ``--quick`` takes the first three."""


def _dense_sweep_rows(bandwidth: float, shapes: list[tuple[int, int, int]], label: str,
                      run_into: Callable[..., object], configs: Callable[[int], dict[str, dict]]) -> list[dict]:
    """Per shape: the best of ``configs(K)`` for ``run_into(x, weight, out, config)`` (each checked
    against the Triton kernel first; all under ``sweep``) beside the Triton W4A16 kernel and cuBLAS
    FP8 / BF16 in the same run."""
    import megatron_quads.kernels.w4a16 as kw
    from megatron_quads.kernels.w4a16 import w4a16_linear_kernel

    rows = []
    for m, k, n in shapes:
        w, qw = _weight(n, k)
        w8 = w.to(torch.float8_e4m3fn)
        one = torch.ones((), device=DEV)
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        x8 = torch.randn(max(m, 16), k, device=DEV).to(torch.float8_e4m3fn)
        out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
        with mock.patch.object(kw, "_WS_DENSE_DISPATCH", False):  # the Triton kernel, not the Gluon dispatch
            best, t_best, sweep = _best_of_sweep(lambda cfg: run_into(x, qw, out, cfg), out,
                                                 w4a16_linear_kernel(x, qw), configs(k))
            t4 = time_graph(lambda: w4a16_linear_kernel(x, qw))
        tb = time_graph(lambda: x @ w.t())
        t8 = time_graph(lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16))
        fp4_bytes = n * k // 2 + n * k // 16 + m * k * 2 + m * n * 2
        rows.append(row(f"w4a16 {label} M={m} K={k} N={n}", t_best, fp4_bytes, 2 * m * n * k, bandwidth, best_config=best,
                        triton_us=round(t4, 2), fp8_us=round(t8, 2), bf16_us=round(tb, 2),
                        speedup_vs_fp8=round(t8 / t_best, 2), speedup_vs_triton=round(t4 / t_best, 2), sweep=sweep))
    return rows


WS_DENSE_CONFIGS = [{}, {"X_WARPS": 0}, {"ROTATED": 1}, {"SPLIT_K": 3}, {"SPLIT_K": 6}, {"SPLIT_K": 3, "ROTATED": 1},
                    {"SPLIT_K": 6, "ROTATED": 1}, {"BLOCK_N": 128, "num_warps": 8, "CTAS_PER_SM": 2},
                    {"BLOCK_N": 128, "num_warps": 8, "CTAS_PER_SM": 2, "SPLIT_K": 2}]
"""Configs of the warp-specialized dense kernel's sweep, over its defaults (``w4a16_ws_dense``)."""

WS_DENSE_SHAPES = [(1, 8192, 8192), (16, 8192, 8192), (32, 8192, 8192), (64, 8192, 8192), (1, 4096, 4096),
                   (16, 4096, 4096), (64, 4096, 4096)]
"""(M, K, N) of the ``w4a16_ws_dense`` section."""


def bench_w4a16_ws_dense(bandwidth: float, quick: bool, shapes: list[tuple[int, int, int]] | None = None) -> list[dict]:
    """The warp-specialized dense kernel (``w4a16_ws_dense``) per decode shape: the best of
    :data:`WS_DENSE_CONFIGS` on natural x (reordered by the kernel's x warps, or with ``X_WARPS`` 0
    by a copy kernel first, as a caller without K-ordered x pays it), that config on x already in
    the K order (TMA), and the copy kernel's reordering alone, beside the Triton kernel, cuBLAS FP8
    and BF16 (``_dense_sweep_rows``)."""
    from megatron_quads.kernels.w4a16 import X_ORDER_BLOCK_K, mma_k_order_rows
    from megatron_quads.kernels.w4a16_ws_dense import w4a16_ws_linear_into

    configs = {",".join(f"{key}={value}" for key, value in cfg.items()) or "default": cfg for cfg in WS_DENSE_CONFIGS}
    shapes = shapes or WS_DENSE_SHAPES
    rows = _dense_sweep_rows(bandwidth, shapes, "ws dense", w4a16_ws_linear_into, lambda k: configs)
    for r, (m, k, n) in zip(rows, shapes, strict=True):
        _, qw = _weight(n, k)
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        ordered = mma_k_order_rows(x, X_ORDER_BLOCK_K)
        out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
        cfg = configs.get(r["best_config"], {})
        r["x_ordered_us"] = round(time_graph(lambda cfg=cfg: w4a16_ws_linear_into(ordered, qw, out, cfg,
                                                                                  x_mma_order=True)), 2)
        r["x_reorder_alone_us"] = round(time_graph(lambda: mma_k_order_rows(x, X_ORDER_BLOCK_K)), 2)
        r["x_ordered_vs_fp8"] = round(r["fp8_us"] / r["x_ordered_us"], 2)
    return rows


def bench_w4a16_mma(bandwidth: float, quick: bool, grouped: bool = True,
                    shapes: list[tuple[int, int, int]] | None = None) -> list[dict]:
    """The experimental Gluon decode kernel (register-operand mma.sync) against the Triton W4A16
    kernel and cuBLAS FP8 / BF16 (:func:`_dense_sweep_rows`; ``quick`` leaves the weight-ring
    configs out); the grouped kernel's rows unless ``grouped=False``; ``shapes`` ((M, K, N) each)
    replaces the dense shapes."""
    from megatron_quads.kernels.w4a16_mma import w4a16_mma_linear_into

    rows = _dense_sweep_rows(bandwidth, shapes or DENSE_DECODE_SHAPES[:3 if quick else None], "mma",
                             w4a16_mma_linear_into, lambda k: _mma_sweep(k, staged=not quick))
    return rows + (_grouped_mma_rows(bandwidth, quick) if grouped else [])


TMA_CONFIGS = [(64, 128, 1, stages, 1, 255) for stages in (2, 4, 6, 8)] + [
    (32, 128, 1, 4, 1, 255), (128, 128, 2, 4, 1, 0), (64, 128, 1, 4, 0, 255), (128, 128, 2, 4, 0, 0),
    (128, 128, 4, 4, 0, 0), (256, 128, 4, 3, 0, 0)]
"""(BLOCK_N, BLOCK_K, num_warps, STAGES, X_RING, maxnreg or 0) of the TMA-ring kernel's sweep: x
through the ring (1) for the small CTAs, the shared x slice (0) where several warps share it."""


def bench_w4a16_tma(bandwidth: float, quick: bool, shapes: list[tuple[int, int, int]] | None = None) -> list[dict]:
    """The experimental TMA-ring Gluon decode kernel (``w4a16_tma``), as :func:`bench_w4a16_mma`'s dense rows."""
    from megatron_quads.kernels.w4a16_tma import w4a16_tma_linear_into

    def configs(k: int) -> dict[str, dict]:
        return {f"{bn}x{bk} w{warps} st{stages}" + (" xr" if x_ring else " xs") + f" s{split}"
                + (f" r{maxnreg}" if maxnreg else ""):
                {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps, "STAGES": stages, "X_RING": x_ring,
                 **({"maxnreg": maxnreg} if maxnreg else {})}
                for bn, bk, warps, stages, x_ring, maxnreg in TMA_CONFIGS for split in (2, 4, 8, 16, 32)
                if k // bk >= split}

    return _dense_sweep_rows(bandwidth, shapes or DENSE_DECODE_SHAPES[:3 if quick else None], "tma",
                             w4a16_tma_linear_into, configs)


def _grouped_mma_rows(bandwidth: float, quick: bool) -> list[dict]:
    """The Gluon grouped kernel at Qwen3-30B-A3B gate/up shapes against the Triton grouped kernel
    and BF16 ``torch._grouped_mm``, best of a config sweep (token tile 8 / 16 / 32 included)."""
    from megatron_quads.kernels.w4a16 import grouped_w4a16_kernel
    from megatron_quads.kernels.w4a16_mma import grouped_w4a16_mma_into

    experts, topk, n, k = 128, 8, 1536, 2048
    w, qw = _weight(n, k, experts)
    w_t = w.transpose(1, 2)
    rows = []
    configs = {f"m{block_m} " + _mma_name(bn, bk, warps, prefetch, stages):
               {"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "PREFETCH": prefetch,
                "STAGES": stages}
               for bn, bk, warps, prefetch, stages in MMA_CONFIGS for block_m in (8, 16, 32)}
    for tokens in (64, 512) if quick else (64, 128, 256, 512):
        counts = _routing(tokens, experts, topk)
        offsets = expert_offsets_from_counts(counts)
        x = torch.randn(tokens * topk, k, device=DEV, dtype=torch.bfloat16)
        out = torch.empty(x.shape[0], n, device=DEV, dtype=torch.bfloat16)
        best, t_mma, sweep = _best_of_sweep(lambda cfg: grouped_w4a16_mma_into(x, qw, offsets, out, cfg), out,
                                            grouped_w4a16_kernel(x, qw, offsets), configs)
        t4 = time_graph(lambda: grouped_w4a16_kernel(x, qw, offsets))
        ends = offsets[1:].contiguous()
        tb = time_graph(lambda: torch._grouped_mm(x, w_t, offs=ends))
        active = int((counts > 0).sum())
        fp4_bytes = _grouped_bytes(active, n, k, x)
        rows.append(row(f"grouped w4a16 mma gate_up tokens={tokens}", t_mma, fp4_bytes, 2 * x.shape[0] * n * k, bandwidth,
                        best_config=best, triton_us=round(t4, 2), bf16_grouped_us=round(tb, 2),
                        speedup_vs_bf16=round(tb / t_mma, 2), speedup_vs_triton=round(t4 / t_mma, 2), sweep=sweep))
    return rows


def _routing(tokens: int, experts: int, topk: int) -> torch.Tensor:
    choice = torch.rand(tokens, experts, device=DEV).topk(topk, dim=1).indices.flatten()
    return torch.bincount(choice, minlength=experts)


def _token_tile_sweep(call) -> dict[str, float]:
    """``call`` timed with each token tile of the grouped kernel (``_grouped_block_m`` pinned; the
    autotuner then picks the weight tile per token tile): the evidence for its default."""
    import megatron_quads.kernels.w4a16 as kw

    times = {}
    for block_m in (16, 32, 64):
        with mock.patch.object(kw, "_grouped_block_m", lambda rows, experts, block_m=block_m: block_m):
            times[f"block_m{block_m}_us"] = round(time_graph(call), 2)
    return times


def bench_grouped(bandwidth: float, quick: bool) -> list[dict]:
    """Grouped MoE W4A16 at Qwen3-30B-A3B expert shapes vs BF16 torch._grouped_mm (and each token tile)."""
    from megatron_quads.kernels.w4a16 import (
        X_ORDER_BLOCK_K,
        grouped_w4a16_kernel,
        mma_k_order_rows,
    )

    rows = []
    for proj, w_t, qw, tokens, counts, offsets, x in _routed_cases(quick):
        n, k = qw.shape[1:]
        active = int((counts > 0).sum())
        fp4_bytes = _grouped_bytes(active, n, k, x)
        ordered_x = mma_k_order_rows(x, X_ORDER_BLOCK_K)  # x in the kernel's K order, for both sweeps
        t4 = time_graph(lambda: grouped_w4a16_kernel(x, qw, offsets))
        tb = time_graph(lambda: torch._grouped_mm(x, w_t, offs=offsets[1:].contiguous()))
        rows.append(row(f"grouped w4a16 {proj} tokens={tokens} (rows {x.shape[0]}, {active} experts)", t4, fp4_bytes,
                        2 * x.shape[0] * n * k, bandwidth, bf16_grouped_us=round(tb, 2), speedup_vs_bf16=round(tb / t4, 2),
                        **_token_tile_sweep(lambda: grouped_w4a16_kernel(x, qw, offsets)),
                        **_full_tile_times(x, ordered_x, qw, offsets),
                        **_x_mma_order_sweep(x, ordered_x, qw, offsets, tokens, tb)))
    return rows


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
        for tokens in (64, 512) if quick else (64, 128, 256, 512):
            counts = _routing(tokens, experts, topk)
            offsets = expert_offsets_from_counts(counts)
            yield proj, w_t, qw, tokens, counts, offsets, torch.randn(tokens * topk, k, device=DEV, dtype=torch.bfloat16)


def _full_tile_times(x: torch.Tensor, ordered_x: torch.Tensor, qw, offsets: torch.Tensor) -> dict[str, float]:
    """The autotuned grouped kernel (on ``x``, and on ``ordered_x``: x in its K order) with the
    half-width token tile for small experts switched off (``w4a16._HALF_TILE``; the same configs,
    picked with it on): its evidence."""
    import megatron_quads.kernels.w4a16 as kw

    calls = {"full_tile_us": lambda: kw.grouped_w4a16_kernel(x, qw, offsets),
             "x_mma_order_full_tile_us": lambda: kw.grouped_w4a16_kernel(ordered_x, qw, offsets, x_mma_order=True)}
    with mock.patch.object(kw, "_WS_DISPATCH", False):
        for call in calls.values():
            call()  # autotune with the half tile on, as the default runs
    with mock.patch.object(kw, "_HALF_TILE", False), mock.patch.object(kw, "_WS_DISPATCH", False):
        return {name: round(time_graph(call), 2) for name, call in calls.items()}


def bench_moe_layer(bandwidth: float, quick: bool) -> list[dict]:
    """The engine's grouped MoE layer (``GroupedExperts``, W4A16 / ``aqat``) at Qwen3-30B-A3B expert
    shapes, routing and gather included, with the kernels' K orders (x before the gather, gate/up
    writing the down input in it) against all natural (``X_ORDER_MIN_ROWS_PER_EXPERT`` raised)."""
    import megatron_quads.kernels.w4a16 as kw
    import megatron_quads.rollout.grouped as grouped_module
    from megatron_quads.rollout.grouped_experts import GroupedExperts, GroupedProjection
    from megatron_quads.rollout.precision import Precision

    experts, topk, hidden, ffn, rows = 128, 8, 2048, 768, []
    layer = GroupedExperts(GroupedProjection(Precision("aqat"), _weight(2 * ffn, hidden, experts)[1]),
                           GroupedProjection(Precision("aqat"), _weight(hidden, ffn, experts)[1]))
    for tokens in (64, 512) if quick else (64, 128, 256, 512):
        x = torch.randn(tokens, hidden, device=DEV, dtype=torch.bfloat16)
        top_k_index = torch.rand(tokens, experts, device=DEV).topk(topk, dim=1).indices
        top_k_weights = torch.rand(tokens, topk, device=DEV)

        def call() -> torch.Tensor:
            return layer(x, top_k_index, top_k_weights, torch.nn.functional.silu)

        ordered = time_graph(call)
        with mock.patch.object(grouped_module, "X_ORDER_MIN_ROWS_PER_EXPERT", 1 << 30):
            natural = time_graph(call)
        with mock.patch.object(kw, "_WS_DISPATCH", False):
            triton_only = time_graph(call)
        routed = tokens * topk
        active = int(torch.unique(top_k_index).numel())
        # the active experts' FP4 weights and scales; bf16 activations of both GEMMs: gate/up reads
        # hidden and writes 2 ffn values a routed row, down reads ffn and writes hidden
        nbytes = active * 3 * hidden * ffn * (1 / 2 + 1 / 16) + routed * (2 * hidden + 3 * ffn) * 2
        rows.append(row(f"moe layer aqat tokens={tokens} (gate/up + down, {active} experts)", ordered, nbytes,
                        2 * routed * 3 * hidden * ffn, bandwidth, natural_order_us=round(natural, 2),
                        triton_grouped_us=round(triton_only, 2),
                        kernel_order_gain=round(natural / ordered - 1, 3),
                        down_in_kernel_order=layer._down_input_in_kernel_order(x, routed / experts)))
    return rows


GROUPED_X_MMA_ORDER_CONFIGS = [(128, 4, 4), (128, 4, 3), (256, 8, 4), (64, 4, 3)]
"""(BLOCK_N, num_warps, num_stages) of the grouped kernel timed with x already in its K order
(``x_mma_order``, BLOCK_K 128): the best three of a session-9 sweep at 512 tokens and the best of a
session-10 one (64 x 128 with the half-width token tile)."""


def _x_mma_order_sweep(x: torch.Tensor, ordered_x: torch.Tensor, qw, offsets: torch.Tensor, tokens: int,
                       bf16_us: float) -> dict[str, float | str]:
    """The grouped kernel on x whose rows are already in its K order (``x_mma_order``: x tiles go from
    shared memory to the MMA as loaded), best of :data:`GROUPED_X_MMA_ORDER_CONFIGS`, each checked bit
    for bit against the natural-order kernel with the same config; the x-order autotuner's pick; and
    what putting x in that order costs as a separate copy (the routed rows, and the ``tokens`` rows
    before the MoE gather, which is where :class:`~megatron_quads.rollout.grouped_experts.GroupedExperts`
    does it); and the tuned call writing its output in that order too (``y_mma_order``, what gate/up
    does for the down projection)."""
    import megatron_quads.kernels.w4a16 as kw
    from megatron_quads.kernels.w4a16 import (
        grouped_w4a16_into,
        grouped_w4a16_kernel,
        mma_k_order_rows,
    )

    natural = torch.empty(x.shape[0], qw.shape[1], device=x.device, dtype=x.dtype)  # each config's natural-order output
    out = torch.empty_like(natural)
    times = {}
    for (bn, warps, stages), block_m in itertools.product(GROUPED_X_MMA_ORDER_CONFIGS, (16, 32) if tokens <= 64 else (32, 64)):
        cfg = {"BLOCK_N": bn, "BLOCK_K": 128, "BLOCK_M": block_m, "num_warps": warps, "num_stages": stages}
        grouped_w4a16_into(x, qw, offsets, natural, cfg)
        grouped_w4a16_into(ordered_x, qw, offsets, out, cfg, x_mma_order=True)
        if not torch.equal(out, natural):
            raise AssertionError(f"x_mma_order with config {cfg} differs from the natural-order kernel")
        times[f"{bn}x128 m{block_m} w{warps} st{stages}"] = time_graph(
            lambda: grouped_w4a16_into(ordered_x, qw, offsets, out, cfg, x_mma_order=True))
    best = min(times, key=times.get)
    hidden = x[:tokens]
    with mock.patch.object(kw, "_WS_DISPATCH", False):  # the Triton kernel's autotuner, not the Gluon dispatch
        tuned = time_graph(lambda: grouped_w4a16_kernel(ordered_x, qw, offsets, x_mma_order=True))
        y_ordered = time_graph(lambda: grouped_w4a16_kernel(ordered_x, qw, offsets, x_mma_order=True, y_mma_order=True))
    return {"x_mma_order_us": round(times[best], 2), "x_mma_order_config": best, "x_mma_order_tuned_us": round(tuned, 2),
            "x_and_y_mma_order_tuned_us": round(y_ordered, 2),
            "x_mma_order_speedup_vs_bf16": round(bf16_us / times[best], 2),
            "order_routed_rows_us": round(time_graph(lambda: mma_k_order_rows(x, 128)), 2),
            "order_tokens_us": round(time_graph(lambda: mma_k_order_rows(hidden, 128)), 2)}


WS_CONFIGS = [
    {},  # the defaults (w4a16_ws.default_config: BLOCK_K 256 and the scale ring where 256 divides K, DYNAMIC up to K 1024)
    {"DYNAMIC": 0},
    {"DYNAMIC": 1},
    {"DYNAMIC": 1, "ROTATED": 1},
    {"ROTATED": 1},
    {"SCALE_RING": 0},
    {"HALF_TILE": 0},
    {"LOADER_REGS": 24},
    {"BLOCK_N": 64, "num_warps": 4, "STAGES": 2, "CTAS_PER_SM": 2, "maxnreg": 128},
    {"BLOCK_N": 256, "num_warps": 16, "STAGES": 2, "CTAS_PER_SM": 1, "maxnreg": 0},
    {"BLOCK_K": 128, "STAGES": 3, "SCALE_RING": 0},
    {"BLOCK_K": 128, "STAGES": 4, "CTAS_PER_SM": 1, "maxnreg": 0, "SCALE_RING": 0},  # the first version's default
    {"BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 128, "STAGES": 3, "CTAS_PER_SM": 3, "maxnreg": 80, "SCALE_RING": 0},
    {"BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 128, "STAGES": 2, "CTAS_PER_SM": 4, "maxnreg": 64, "SCALE_RING": 0},
    {"BLOCK_N": 256, "num_warps": 16, "BLOCK_K": 128, "STAGES": 3, "CTAS_PER_SM": 1, "maxnreg": 0, "SCALE_RING": 0},
]
"""Configs of the warp-specialized grouped kernel (``w4a16_ws``) timed by ``--only grouped_ws``, over
its defaults (:func:`~megatron_quads.kernels.w4a16_ws.default_config`)."""


def bench_grouped_ws(bandwidth: float, quick: bool) -> list[dict]:
    """The warp-specialized Gluon grouped kernel at Qwen3-30B-A3B expert shapes, x in its K order,
    best of :data:`WS_CONFIGS` (each checked against the Triton kernel first), against the Triton
    kernel on the same x (its autotuner) and BF16 ``torch._grouped_mm``."""
    from triton.errors import TritonError

    import megatron_quads.kernels.w4a16 as kw
    from megatron_quads.kernels.w4a16 import (
        X_ORDER_BLOCK_K,
        grouped_w4a16_kernel,
        mma_k_order_rows,
    )
    from megatron_quads.kernels.w4a16_ws import grouped_w4a16_ws_into

    named_configs = {",".join(f"{key}={value}" for key, value in cfg.items()) or "default": cfg for cfg in WS_CONFIGS}
    rows = []
    for proj, w_t, qw, tokens, counts, offsets, x in _routed_cases(quick):
        n, k = qw.shape[1:]
        ordered_x = mma_k_order_rows(x, X_ORDER_BLOCK_K)
        with mock.patch.object(kw, "_WS_DISPATCH", False):  # the Triton kernel (its autotuner)
            reference = grouped_w4a16_kernel(ordered_x, qw, offsets, x_mma_order=True)
            t_triton = time_graph(lambda: grouped_w4a16_kernel(ordered_x, qw, offsets, x_mma_order=True))
        out = torch.empty_like(reference)
        expected = reference.float()
        atol = 1e-3 * float(expected.abs().max())
        times, same_bits, wrong = {}, {}, {}
        for name, cfg in named_configs.items():
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
        best = min(times, key=times.get)
        t_y_order = time_graph(lambda: grouped_w4a16_ws_into(ordered_x, qw, offsets, out, named_configs[best],
                                                             y_mma_order=True))
        tb = time_graph(lambda: torch._grouped_mm(x, w_t, offs=offsets[1:].contiguous()))
        active = int((counts > 0).sum())
        fp4_bytes = _grouped_bytes(active, n, k, x)
        rows.append(row(f"grouped w4a16 ws {proj} tokens={tokens} (rows {x.shape[0]}, {active} experts)", times[best],
                        fp4_bytes, 2 * x.shape[0] * n * k, bandwidth, best_config=best,
                        triton_x_mma_order_us=round(t_triton, 2), y_mma_order_us=round(t_y_order, 2),
                        bf16_grouped_us=round(tb, 2), speedup_vs_bf16=round(tb / times[best], 2),
                        speedup_vs_triton=round(t_triton / times[best], 2), same_bits_as_triton=same_bits, wrong=wrong,
                        sweep={name: round(t, 2) for name, t in times.items()}))
    return rows


def _both_rac_paths(call, kind: str) -> tuple[float, float]:
    """``call`` timed on the W4A16 path (prologue bf16 block values + W4A16 kernel) and on the RAC GEMM
    (``W4A16_PATH_ROWS[kind]`` forced either way): the evidence for the default thresholds."""
    import megatron_quads.kernels.w4a4 as kw

    with mock.patch.dict(kw.W4A16_PATH_ROWS, {kind: 1 << 62}):
        via_w4a16 = time_graph(call, calls=10)
    with mock.patch.dict(kw.W4A16_PATH_ROWS, {kind: 0}):
        via_rac_gemm = time_graph(call, calls=10)
    return via_w4a16, via_rac_gemm


def bench_rac(bandwidth: float, quick: bool) -> list[dict]:
    """W4A4 + RAC against plain emulated W4A4, dense and grouped, per residual ratio; each case on both
    GEMM paths (``us`` is the one the default ``W4A16_PATH_ROWS`` picks)."""
    from megatron_quads.kernels.w4a4 import (
        W4A16_PATH_ROWS,
        grouped_rac_kernel,
        rac_linear_kernel,
    )

    rows = []
    for m, k, n in ((16, 4096, 4096), (2048, 4096, 4096)):
        _, qw = _weight(n, k)
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        base = None
        for ratio in (0.0, 0.125, 0.25, 0.5, 1.0):
            channels = select_channels(torch.rand(k, device=DEV), ratio).to(DEV)
            residual = reblock_columns(qw, channels) if channels.numel() else None
            via_w4a16, via_rac_gemm = _both_rac_paths(lambda: rac_linear_kernel(x, qw, channels, residual), "dense")
            t = via_w4a16 if m <= W4A16_PATH_ROWS["dense"] else via_rac_gemm
            base = base or t
            s = num_residual_channels(k, ratio)
            nbytes = (n * (k + s)) // 2 + n * (k + s) // 16 + m * k * 2 + m * n * 2
            rows.append(row(f"w4a4+rac M={m} K={k} N={n} ratio={ratio}", t, nbytes, 2 * m * n * (k + s), bandwidth,
                            overhead_vs_w4a4=round(t / base - 1, 3), w4a16_path_us=round(via_w4a16, 2),
                            rac_gemm_us=round(via_rac_gemm, 2)))
    experts, topk, k, n = 128, 8, 2048, 1536
    _, qw = _weight(n, k, experts)
    for tokens, ratios in ((256, (0.0, 0.25, 0.5)), (4096, (0.0, 0.25))):  # decode; prefill (256 rows per expert)
        counts = _routing(tokens, experts, topk)
        offsets = expert_offsets_from_counts(counts)
        x = torch.randn(tokens * topk, k, device=DEV, dtype=torch.bfloat16)
        base = None
        for ratio in ratios:
            s = num_residual_channels(k, ratio)
            if s:
                channels = torch.stack([select_channels(torch.rand(k, device=DEV), ratio) for _ in range(experts)]).to(DEV)
                residual = _stacked_rac_residual(qw, channels, s)
            else:
                channels = residual = None
            via_w4a16, via_rac_gemm = _both_rac_paths(lambda: grouped_rac_kernel(x, qw, offsets, channels, residual), "grouped")
            t = via_w4a16 if -(-x.shape[0] // experts) <= W4A16_PATH_ROWS["grouped"] else via_rac_gemm
            base = base or t
            active = int((counts > 0).sum())  # experts whose weights are read, as in bench_grouped
            nbytes = active * ((n * (k + s)) // 2 + n * (k + s) // 16) + x.shape[0] * (k * 2 + n * 2)
            rows.append(row(f"grouped w4a4+rac gate_up tokens={tokens} ratio={ratio}", t, nbytes,
                            2 * x.shape[0] * n * (k + s), bandwidth, overhead_vs_w4a4=round(t / base - 1, 3),
                            w4a16_path_us=round(via_w4a16, 2), rac_gemm_us=round(via_rac_gemm, 2)))
    return rows


def _stacked_rac_residual(qw, channels: torch.Tensor, s: int):
    """The RAC residual weight ``[E, N, S]`` of stacked ``qw`` at each expert's channel set."""
    experts, n = qw.shape[0], qw.shape[1]
    parts = [reblock_columns(expert_weight(qw, e), channels[e]) for e in range(experts)]
    return type(qw)(codes=torch.stack([p.codes for p in parts]), scales=torch.stack([p.scales for p in parts]),
                    weight_scale_2=qw.weight_scale_2, shape=torch.Size((experts, n, s)), dtype=qw.dtype)


def bench_rac_ws(bandwidth: float, quick: bool) -> list[dict]:
    """Grouped W4A4 + RAC at Qwen3-30B-A3B gate/up and down (the engine's ``quads`` / ``w4a4`` MoE
    GEMMs): the default path (the prologue's block values in the K order, the GEMM on the
    warp-specialized kernel, a tail that is not whole 256-column steps widened to them:
    ``tail_width``) against the same call with that dispatch off (natural order, the Triton grouped
    kernel), checked to agree within the fp32 bound before either is timed."""
    import megatron_quads.kernels.w4a16 as kw
    from megatron_quads.kernels.w4a4 import (
        TAIL_PAD_MAX_GROWTH,
        grouped_rac_kernel,
    )

    experts, topk = 128, 8
    rows = []
    for (proj, k, n), tokens in itertools.product((("gate_up", 2048, 1536), ("down", 768, 2048)), (64, 512)):
        _, qw = _weight(n, k, experts)
        counts = _routing(tokens, experts, topk)
        offsets = expert_offsets_from_counts(counts)
        x = torch.randn(tokens * topk, k, device=DEV, dtype=torch.bfloat16)
        for ratio in (0.0, 0.125, 0.25):
            s = num_residual_channels(k, ratio)
            channels = (torch.stack([select_channels(torch.rand(k, device=DEV), ratio) for _ in range(experts)]).to(DEV)
                        if s else None)
            residual = _stacked_rac_residual(qw, channels, s) if s else None

            def call(channels=channels, residual=residual):
                return grouped_rac_kernel(x, qw, offsets, channels, residual)

            with mock.patch.object(kw, "_WS_DISPATCH", False):
                reference = call().float()
                t_triton = time_graph(call)
            agrees = bool(torch.allclose(call().float(), reference, rtol=2**-7,
                                         atol=1e-3 * float(reference.abs().max())))
            t_ws = time_graph(call) if agrees else float("nan")
            active = int((counts > 0).sum())
            nbytes = active * ((n * (k + s)) // 2 + n * (k + s) // 16) + x.shape[0] * (k * 2 + n * 2)
            width = kw.warp_specialized_tail_width(x.device, k, s)
            rows.append(row(f"grouped w4a4+rac {proj} tokens={tokens} ratio={ratio} (S {s})", t_ws, nbytes,
                            2 * x.shape[0] * n * (k + s), bandwidth, triton_natural_us=round(t_triton, 2),
                            speedup_vs_triton=round(t_triton / t_ws, 2), agrees_with_triton=agrees,
                            tail_width=width if s and k + width <= TAIL_PAD_MAX_GROWTH * (k + s) else s))
    return rows


SECTION_ORDER = ["quantize", "quantize_tiles", "w4a16", "w4a16_ws_dense", "w4a16_mma", "grouped", "grouped_ws", "moe_layer", "rac", "rac_ws"]
"""The order of the sections in the Markdown view (others follow by name)."""


def markdown_view(records: dict[str, dict]) -> str:
    """Each section's table (its record in ``kernels_gpu.json``) under the date, device, command and
    copy bandwidth of the run that measured it (runs with ``--only`` refresh some sections)."""
    lines = ["# NVFP4 kernels on the GPU: the newest run of each section", "",
             ("From `kernels_gpu.json`. `floor_us`: bytes / the copy bandwidth measured in the same "
              "run; `frac_of_floor`: floor_us / us. GEMMs timed by CUDA-graph replay."), ""]
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
    """All cases, one record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--only", nargs="*", default=["quantize", "w4a16", "grouped", "grouped_ws", "rac"],
                        help="sections (grouped_ws: the warp-specialized Gluon grouped kernel); extra: quantize_tiles "
                             "(each quantize tile config), moe_layer (the engine's grouped MoE layer), w4a16_mma (the "
                             "experimental Gluon kernels), w4a16_mma_dense (its dense rows only), w4a16_tma (the TMA-ring kernel), "
                             "w4a16_ws_dense (the warp-specialized dense kernel)")
    parser.add_argument("--render", action="store_true", help="only rewrite kernels_gpu.md from kernels_gpu.json (no GPU)")
    parser.add_argument("--mma-shape", action="append", type=_shape_arg, default=None, metavar="M,K,N",
                        help="dense shape of the w4a16_mma / w4a16_tma / w4a16_ws_dense sections instead of their default list "
                             "(repeatable)")
    args = parser.parse_args()
    out = Path(__file__).parent / "results" / "kernels_gpu.json"
    if args.render:
        write_text_atomic(out.with_suffix(".md"), markdown_view(load_records(out)))
        return
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    sections = {"quantize": lambda: bench_quantize(bandwidth, 8192), "quantize_tiles": lambda: bench_quantize_tiles(bandwidth, 8192),
                "w4a16": lambda: bench_w4a16(bandwidth, args.quick),
                "grouped": lambda: bench_grouped(bandwidth, args.quick), "rac": lambda: bench_rac(bandwidth, args.quick),
                "moe_layer": lambda: bench_moe_layer(bandwidth, args.quick),
                "grouped_ws": lambda: bench_grouped_ws(bandwidth, args.quick),
                "rac_ws": lambda: bench_rac_ws(bandwidth, args.quick),
                "w4a16_mma": lambda: bench_w4a16_mma(bandwidth, args.quick, shapes=args.mma_shape),
                "w4a16_mma_dense": lambda: bench_w4a16_mma(bandwidth, args.quick, grouped=False, shapes=args.mma_shape),
                "w4a16_tma": lambda: bench_w4a16_tma(bandwidth, args.quick, shapes=args.mma_shape),
                "w4a16_ws_dense": lambda: bench_w4a16_ws_dense(bandwidth, args.quick, shapes=args.mma_shape)}
    command = ("python benchmarks/bench_kernels.py" + (" --quick" if args.quick else "")
               + (f" --only {' '.join(args.only)}" if args.only != parser.get_default("only") else "")
               + "".join(f" --mma-shape {','.join(map(str, shape))}" for shape in args.mma_shape or []))
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
