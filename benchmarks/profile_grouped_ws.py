"""Profiler target: the warp-specialized grouped kernel at a Qwen3-30B-A3B projection, 512 tokens, x in K order.

    CFG='{"BLOCK_K": 128, "STAGES": 4}' ncu --clock-control none -k regex:_grouped_ws_kernel \\
        -c 1 -s 2 --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,\\
    smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.per_cycle_active,\\
    dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum' python benchmarks/profile_grouped_ws.py

``PROJ=down`` takes the down projection (N 2048, K 768) instead of gate/up (N 1536, K 2048); the
session-13 profile ran ``ncu --clock-control none --set full -k regex:_grouped_ws_kernel -c 1 -s 2``
on both. ``CFG`` is a JSON config over :func:`~megatron_quads.kernels.w4a16_ws.default_config`; the
session-11 profile in docs/kernels.md took the one above (2 CTAs an SM, ``maxnreg`` 80 as the default)
and ``{"BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 128, "STAGES": 3, "CTAS_PER_SM": 3}``. Four launches;
``-s 2`` skips the first two (compilation, warm-up).
"""

from __future__ import annotations

import json
import os

import torch
from bench_kernels import _routing, _weight

from megatron_quads.kernels.w4a16 import mma_k_order_rows
from megatron_quads.kernels.w4a16_ws import grouped_w4a16_ws_into
from megatron_quads.rollout.grouped import expert_offsets_from_counts


def main() -> None:
    """Launch the kernel four times on the case."""
    torch.manual_seed(0)
    n, k = (2048, 768) if os.environ.get("PROJ") == "down" else (1536, 2048)
    experts, topk, tokens = 128, 8, 512
    _, weight = _weight(n, k, experts)
    offsets = expert_offsets_from_counts(_routing(tokens, experts, topk))
    x = mma_k_order_rows(torch.randn(tokens * topk, k, device="cuda", dtype=torch.bfloat16), 128)
    out = torch.empty(x.shape[0], n, device="cuda", dtype=torch.bfloat16)
    config = json.loads(os.environ.get("CFG", "{}"))
    for _ in range(4):
        grouped_w4a16_ws_into(x, weight, offsets, out, config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
