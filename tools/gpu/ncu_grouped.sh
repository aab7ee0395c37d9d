#!/usr/bin/env bash
# On the GPU machine: Nsight Compute on one launch of a grouped W4A16 kernel at a decode size
# (tools/tune_grouped_w4a16.py --launch-only), the sections that say where a weight-streaming GEMM's
# time goes (speed of light, memory, warp stalls, scheduler, occupancy), as text in $OUT.
#
#   bash tools/gpu/ncu_grouped.sh ws|triton TOKENS [NAME:N,K]     (default gate_up:1536,2048)
set -euo pipefail
kernel=${1:?usage: ncu_grouped.sh ws|triton TOKENS [NAME:N,K]}
tokens=${2:?usage: ncu_grouped.sh ws|triton TOKENS [NAME:N,K]}
shape=${3:-gate_up:1536,2048}
name=$([[ $kernel == ws ]] && echo _grouped_ws_kernel || echo _grouped_kernel)
out="${OUT:-/tmp}/ncu_${kernel}_${shape%%:*}_t${tokens}.txt"
ncu --clock-control none --kernel-name "regex:^${name}\$" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats --page details --print-units base \
    python3 tools/tune_grouped_w4a16.py --launch-only "$kernel" --tokens "$tokens" --shape "$shape" > "$out" 2>&1
grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Stall|Registers Per Thread|Grid Size" "$out" | head -30
