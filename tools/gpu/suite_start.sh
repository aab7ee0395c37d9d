#!/usr/bin/env bash
# On the GPU machine after install.sh: the kernel and dispatch GPU tests, the GPU tests against the
# real vLLM engine, then benchmarks/bench_vllm.py --profile gpu (extra arguments go to it), one after
# the other and detached (they outlive the call; the machine stays warm while calls follow). Logs
# and results under /tmp/bench_out; tools/gpu/bench_wait.sh collects them.
set -euo pipefail
rm -rf /tmp/bench_repo /tmp/bench_out && mkdir -p /tmp/bench_out
cp -r . /tmp/bench_repo
cd /tmp/bench_repo
bench_args=$(printf ' %q' "$@")
PYTHONPATH=/tmp/site setsid nohup bash -c "
python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_kernels_w4a16_ws.py tests/test_kernels_w4a4.py \
    tests/test_kernels_expert_stacks.py tests/test_dispatch_gpu.py tests/test_grouped.py > /tmp/bench_out/test_kernels_gpu.log 2>&1
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_vllm_gpu.py > /tmp/bench_out/test_vllm_gpu.log 2>&1
python3 benchmarks/bench_vllm.py --profile gpu --out /tmp/bench_out/vllm.json --results-dir /tmp/bench_out$bench_args \
    > /tmp/bench_out/bench.log 2>&1" < /dev/null > /dev/null 2>&1 &
echo "started pid $!"
