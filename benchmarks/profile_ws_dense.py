"""Profiler target: the warp-specialized dense decode kernel (``w4a16_ws_dense``) on one shape.

    ncu --clock-control none --set full -k regex:_dense_ws_kernel -c 1 -s 2 python benchmarks/profile_ws_dense.py

``SHAPE=M,K,N`` (default ``16,8192,8192``), ``ORDERED=1`` passes x already in the kernel's K order
(its TMA path) instead of natural x (the x warps), ``CFG`` a JSON config over the defaults. Four
launches; ``-s 2`` skips the first two (compilation, warm-up).
"""

from __future__ import annotations

import json
import os

import torch
from bench_kernels import _weight

from megatron_quads.kernels.w4a16 import X_ORDER_BLOCK_K, mma_k_order_rows
from megatron_quads.kernels.w4a16_ws_dense import w4a16_ws_linear_into


def main() -> None:
    """Launch the kernel four times on the shape."""
    torch.manual_seed(0)
    m, k, n = (int(v) for v in os.environ.get("SHAPE", "16,8192,8192").split(","))
    _, weight = _weight(n, k)
    ordered = os.environ.get("ORDERED") == "1"
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if ordered:
        x = mma_k_order_rows(x, X_ORDER_BLOCK_K)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    config = json.loads(os.environ.get("CFG", "{}"))
    for _ in range(4):
        w4a16_ws_linear_into(x, weight, out, config, x_mma_order=ordered)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
