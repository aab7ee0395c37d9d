"""Timing only: the warp-specialized grouped kernel (``w4a16_ws``) as a split-K dense decode GEMM.

    python benchmarks/diag_ws_dense.py     # appends a record to results/diag_ws_dense.json

Would the loader-warp / register-A wgmma design help the unmet dense target (8192^2, M = 16: >= 1.6x
FP8)? The grouped kernel has no split-K, so split ``s`` of K is posed as expert ``s``: its 16 token
rows are ``x[:, K_s]`` and its weight ``W[:, K_s]``; the output is the ``[S * 16, N]`` partials (bf16,
not summed: a split-K kernel's partial stores and reduction are not counted). Against the Triton
dense kernel and FP8 ``torch._scaled_mm`` in the same run.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
from bench_kernels import time_graph
from results_io import append_record

OUT = Path(__file__).parent / "results" / "diag_ws_dense.json"
M, N, K = 16, 8192, 8192
CONFIGS = {
    "default": {},
    "bk128": {"BLOCK_K": 128, "STAGES": 4},
    "bn64 3 ctas": {"BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 128, "STAGES": 3, "CTAS_PER_SM": 3},
    "bn64 3 ctas bk256": {"BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 256, "STAGES": 2, "CTAS_PER_SM": 3},
    "bn64 4 ctas": {"BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 128, "STAGES": 2, "CTAS_PER_SM": 4, "maxnreg": 64},
}
"""``w4a16_ws`` configs over its defaults (``BLOCK_M`` 16 for all)."""


def as_experts(x: torch.Tensor, w: torch.Tensor, splits: int):
    """``(x's K slices as expert rows [S * M, K / S], weight [S, N, K / S] NVFP4, offsets)``: split
    ``s`` of K as expert ``s`` (rows in natural order; the kernel takes them through ``mma_k_order_rows``)."""
    from megatron_quads.nvfp4.quantize import quantize

    (m, k), n = x.shape, w.shape[0]
    stacked = w.reshape(n, splits, k // splits).permute(1, 0, 2).contiguous()
    weight = quantize(stacked, global_amax=stacked.abs().amax(dim=(1, 2)).unsqueeze(1))
    rows = x.reshape(m, splits, k // splits).permute(1, 0, 2).reshape(splits * m, k // splits).contiguous()
    return rows, weight, torch.arange(0, splits * m + 1, m, device=x.device, dtype=torch.int32)


def main() -> None:
    """Time every split and config; append one record."""
    from megatron_quads.kernels.w4a16 import mma_k_order_rows, w4a16_linear_kernel
    from megatron_quads.kernels.w4a16_ws import grouped_w4a16_ws_into
    from megatron_quads.nvfp4.quantize import quantize

    torch.manual_seed(0)
    w = torch.randn(N, K, device="cuda") * 0.02
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dense = quantize(w, global_amax=w.abs().amax())
    one = torch.ones((), device="cuda")
    w8, x8 = w.to(torch.float8_e4m3fn), x.to(torch.float8_e4m3fn)
    results = {"triton_dense_us": round(time_graph(lambda: w4a16_linear_kernel(x, dense)), 2),
               "fp8_us": round(time_graph(lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16)), 2)}
    for splits in (2, 4, 8):
        rows, weight, offsets = as_experts(x, w, splits)
        rows = mma_k_order_rows(rows, 128)
        out = torch.empty(splits * M, N, device="cuda", dtype=torch.bfloat16)
        for name, cfg in CONFIGS.items():
            cfg = {**cfg, "BLOCK_M": 16}
            t = time_graph(lambda cfg=cfg, args=(rows, weight, offsets, out): grouped_w4a16_ws_into(*args, cfg))
            results[f"split {splits} {name}"] = round(t, 2)
            print(f"split {splits} {name}: {t:.2f} us ({results['fp8_us'] / t:.2f}x fp8)", flush=True)
    print(results, flush=True)
    append_record(OUT, {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                        "device": torch.cuda.get_device_name(), "command": "python benchmarks/diag_ws_dense.py",
                        "shape": {"M": M, "N": N, "K": K}, "results_us": results})


if __name__ == "__main__":
    main()
