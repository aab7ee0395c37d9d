"""Timing probes: where the dense warp-specialized W4A16 decode kernel's time goes (M = 16).

    python benchmarks/diag_ws_dense_floor.py     # appends a record to results/diag_ws_dense_floor.json

The dense target of issue 7 (>= 1.6x cuBLAS FP8 at K, N >= 4096 and M <= 16) is unmet; these probes
say which part of ``w4a16_ws_linear_into`` holds it. Times only (the probes' outputs are garbage):

1. ablations, each in a fresh process (the patched globals are compile-time constants of the
   kernel): the dequantization PTX replaced by register moves (``no_dequant``), the loader skipping
   the x tiles (``no_x``), both, and all of that with the wgmma and their waits removed as well
   (``no_mma``: what is left is the TMA ring of code words and scale bytes, its mbarrier handshakes
   and the split-K epilogue); natural x (the x warps reorder it) and x already in K order, L2-warm
   and L2-cold (weight copies rotated), with the dispatched config and with a deep ring
   (:data:`DEEP_RING`: the ring-only probe's fastest of a one-off sweep);
2. register-A wgmma chains alone (``m64 x BM x k16``, eight a 128-column sub-step, waited every 1 or
   4 sub-steps), as many as the 8192^2 GEMM issues, over 256 to 1056 CTAs;
3. an empty kernel, and the best streaming read of the FP4 weight bytes (codes and scale bytes) with
   the same bytes every call (L2-warm, as ``bench_kernels.py`` times) and with copies rotated so
   that their total passes the H200's 50 MB L2 (L2-cold).

The dispatched kernel and cuBLAS FP8 L2-warm and L2-cold are ``bench_kernels.py``'s w4a16 section
(the first record here, 2026-11-30T18:17, also timed them: ``l2_probes_us``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from bench_kernels import _weight, l2_cold_copies, rotating, time_graph
from results_io import append_record
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from megatron_quads.kernels.w4a16_ws import wgmma_layout, x_tile_layout

OUT = Path(__file__).parent / "results" / "diag_ws_dense_floor.json"
SHAPES = [(16, 8192, 8192), (16, 4096, 4096)]
"""(M, K, N) of the ablations and the L2 probes."""
ABLATIONS = ["none", "no_dequant", "no_x", "no_dequant,no_x", "no_dequant,no_x,no_mma"]
DEEP_RING = {"STAGES": 8, "CTAS_PER_SM": 1, "SPLIT_K": 1}
"""One program an SM with 8 ring stages and no split (a tile a program): the fastest ring-only
config of a one-off H200 sweep of stages (3-12), CTAs an SM (1-3), splits (1-4), BLOCK_N 64/128 and
tile-major weights (H200, 2026-11-30 ~19:55: 11.80 us L2-cold at 8192^2, against 14.6 for the default)."""
MOVES_PTX = "{\nmov.b32 {$0, $1}, $8;\nmov.b32 {$2, $3}, $8;\nmov.b32 {$4, $5}, $9;\nmov.b32 {$6, $7}, $9;\n}"
"""The ``no_dequant`` stand-in for the word decode: the operand registers filled by moves."""


@gluon.jit
def _wgmma_chain_kernel(out_ptr, SUBSTEPS: gl.constexpr, BM: gl.constexpr, WAIT_EVERY: gl.constexpr):
    """``SUBSTEPS`` sub-steps of two register-A ``[64, 64] x [64, BM]`` wgmma (eight k16 instructions),
    waited every ``WAIT_EVERY``: the dense kernel's MMA stream without its loads or dequantization."""
    MMA: gl.constexpr = wgmma_layout(BM, 4)
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    FILL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    xs = gl.allocate_shared_memory(gl.bfloat16, [2, BM, 64], x_tile_layout(BM))
    xs.index(0).store(gl.full([BM, 64], 0.0, gl.bfloat16, FILL))
    xs.index(1).store(gl.full([BM, 64], 0.0, gl.bfloat16, FILL))
    fence_async_shared()
    acc = gl.zeros((64, BM), gl.float32, layout=MMA)
    a = gl.full([64, 64], 1.0, gl.bfloat16, A)
    for _ in range(SUBSTEPS // WAIT_EVERY):
        for _j in gl.static_range(WAIT_EVERY):
            acc = warpgroup_mma(a, xs.index(0).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(a, xs.index(1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    cols = gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
    gl.store(out_ptr + gl.program_id(0) * 64 * BM + rows[:, None] * BM + cols[None, :], acc)


@triton.jit
def _empty_kernel(out_ptr):
    pass


@gluon.jit
def _no_mma(a, b, acc, is_async: gl.constexpr):
    """The ``no_mma`` stand-in for ``warpgroup_mma``: the accumulator as it was."""
    return acc


@gluon.jit
def _no_mma_wait(num_outstanding: gl.constexpr, deps):
    """The ``no_mma`` stand-in for ``warpgroup_mma_wait``."""
    return deps[0]


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Each program xors ``ITERS`` blocks of int32 words and stores one word: a streaming read."""
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    base = tl.program_id(0) * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


def apply_ablation(names: str) -> None:
    """Patch the kernels' compile-time globals for the probes in ``names`` (comma-separated, from
    :data:`ABLATIONS`), for the rest of this process."""
    import megatron_quads.kernels.w4a16_ws as ws
    import megatron_quads.kernels.w4a16_ws_dense as ws_dense

    known = {name for combination in ABLATIONS for name in combination.split(",")}
    unknown = set(names.split(",")) - known
    if unknown:
        raise ValueError(f"unknown probe(s) {sorted(unknown)}: use {', '.join(sorted(known))}")
    if "no_dequant" in names:
        ws._DEQUANT_WORD_PTX = gl.constexpr(MOVES_PTX)
    if "no_x" in names:
        ws_dense._LOAD_X = gl.constexpr(False)
    if "no_mma" in names:
        ws.warpgroup_mma = _no_mma
        ws.warpgroup_mma_wait = _no_mma_wait


def run_ablation(names: str) -> dict[str, float]:
    """Time ``w4a16_ws_linear_into`` with the probes in ``names`` applied (this process only)."""
    import megatron_quads.kernels.w4a16_ws_dense as ws_dense
    from megatron_quads.kernels.w4a16 import X_ORDER_BLOCK_K, mma_k_order_rows

    apply_ablation(names)

    results = {}
    torch.manual_seed(0)
    for m, k, n in SHAPES:
        copies = [_weight(n, k)[1] for _ in range(l2_cold_copies(n * k // 2 + n * k // 16))]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ordered = mma_k_order_rows(x, X_ORDER_BLOCK_K)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        for config_name, config in (("", None), (", deep ring", DEEP_RING)):
            for x_name, x_in, x_kwargs in (("natural x", x, {}), ("x in K order", ordered, {"x_mma_order": True})):
                calls = [partial(ws_dense.w4a16_ws_linear_into, x_in, q, out, config=config, **x_kwargs)
                         for q in copies]
                for call in calls:
                    call()  # each copy's first call outside the timed graphs
                key = f"{m}x{k}x{n} {x_name}{config_name}"
                results[key] = time_graph(calls[0])
                results[key + ", L2-cold"] = time_graph(rotating(calls))
        del copies
    return {key: round(t, 2) for key, t in results.items()}


def wgmma_chains() -> dict[str, float]:
    """Probe 2: the 8192^2 GEMM's 65536 register-A wgmma (``BM`` 16), and at ``BM`` 64 for M = 64."""
    results = {}
    substeps_total = 8192 * 8192 // (64 * 128)
    for bm in (16, 64):
        for programs in (256, 396, 1056):
            for wait_every in (1, 4):
                out = torch.empty(programs * 64 * bm, device="cuda")
                substeps = substeps_total // programs // wait_every * wait_every
                launch = partial(_wgmma_chain_kernel[(programs,)], out, substeps, bm, wait_every, num_warps=4)
                results[f"BM {bm}, {programs} CTAs, wait every {wait_every}"] = round(time_graph(launch), 2)
    return results


def l2_probes() -> dict[str, float | str]:
    """Probe 3: the empty kernel and the streaming read, L2-warm and cold."""
    sink = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    results: dict[str, float | str] = {"empty kernel": round(time_graph(lambda: _empty_kernel[(1,)](sink)), 2)}
    for m, k, n in SHAPES:
        nbytes = n * k // 2 + n * k // 16
        words = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
                 for _ in range(l2_cold_copies(nbytes))]

        def read(src: torch.Tensor, block: int, iters: int) -> Callable[[], object]:
            return lambda: _read_kernel[(triton.cdiv(src.numel(), block * iters),)](src, sink, src.numel(), block, iters)

        grid = [(block, iters) for block in (1024, 2048, 4096) for iters in (1, 2, 4, 8)
                if triton.cdiv(nbytes // 4, block * iters) <= sink.numel()]
        warm = {f"{b}x{i}": time_graph(read(words[0], b, i)) for b, i in grid}
        cold = {f"{b}x{i}": time_graph(rotating([read(w, b, i) for w in words])) for b, i in grid}
        shape = f"{m}x{k}x{n}"
        for name, times in (("L2-warm", warm), ("L2-cold", cold)):
            best = min(times, key=times.get)
            results[f"{shape} read of the {nbytes} FP4 bytes, {name}"] = round(times[best], 2)
            results[f"{shape} read {name} block x iters"] = best
        del words
    return results


def main() -> None:
    """Every probe; one record appended to :data:`OUT` (or, with ``--ablation``, one JSON line printed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ablation", help="time the kernel with these probes applied and print JSON (internal)")
    args = parser.parse_args()
    if args.ablation is not None:
        print(json.dumps(run_ablation(args.ablation)))
        return
    ablations = {}
    for names in ABLATIONS:
        done = subprocess.run([sys.executable, __file__, "--ablation", names], capture_output=True, text=True,
                              check=True)
        ablations[names] = json.loads(done.stdout.strip().splitlines()[-1])
        print(names, ablations[names], flush=True)
    record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "command": "python benchmarks/diag_ws_dense_floor.py",
              "ablations_us": ablations, "wgmma_chains_us": wgmma_chains(), "l2_probes_us": l2_probes()}
    print(json.dumps(record, indent=1), flush=True)
    append_record(OUT, record)


if __name__ == "__main__":
    main()
