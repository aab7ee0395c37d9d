#!/usr/bin/env bash
# On the GPU machine after install.sh: every GPU test but vLLM's (kernels, dispatch, engine, trainer;
# 8 workers), the GPU tests against the real vLLM engine (skipped with VLLM_TESTS=0), then
# benchmarks/bench_vllm.py --profile gpu (extra arguments go to it), one after the other and detached (they outlive the call; the machine stays warm while calls follow). Logs
# and results under /tmp/bench_out; tools/gpu/bench_wait.sh collects them.
set -euo pipefail
rm -rf /tmp/bench_repo /tmp/bench_out && mkdir -p /tmp/bench_out
cp -r . /tmp/bench_repo
cd /tmp/bench_repo
bench_args=$(printf ' %q' "$@")
PYTHONPATH=/tmp/site setsid nohup bash -c "
python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/ --ignore=tests/test_vllm_gpu.py \
    > /tmp/bench_out/test_gpu.log 2>&1
if [[ ${VLLM_TESTS:-1} != 0 ]]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_vllm_gpu.py > /tmp/bench_out/test_vllm_gpu.log 2>&1
fi
python3 benchmarks/bench_vllm.py --profile gpu --out /tmp/bench_out/vllm.json --results-dir /tmp/bench_out$bench_args \
    > /tmp/bench_out/bench.log 2>&1" < /dev/null > /dev/null 2>&1 &
echo "started pid $!"
