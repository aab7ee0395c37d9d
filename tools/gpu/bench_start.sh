#!/usr/bin/env bash
# On the GPU machine after install.sh: start benchmarks/bench_vllm.py --profile gpu detached (it outlives
# the call; the machine stays warm while calls follow), results under /tmp/bench_out. Extra arguments
# go to the benchmark, e.g. --modes bf16 fp8 w4a16 --profile-batches 64.
set -euo pipefail
rm -rf /tmp/bench_repo /tmp/bench_out && mkdir -p /tmp/bench_out
cp -r . /tmp/bench_repo
cd /tmp/bench_repo
PYTHONPATH=/tmp/site setsid nohup python3 benchmarks/bench_vllm.py --profile gpu --out /tmp/bench_out/vllm.json \
    --results-dir /tmp/bench_out "$@" > /tmp/bench_out/bench.log 2>&1 < /dev/null &
echo "started pid $!"
