#!/usr/bin/env bash
# On the GPU machine: wait up to SECONDS for the detached benchmark, then copy its results to $OUT.
set -uo pipefail
limit=${1:?usage: tools/gpu/bench_wait.sh SECONDS}
end=$((SECONDS + limit))
while (( SECONDS < end )) && pgrep -f bench_vllm.py > /dev/null; do sleep 5; done
pgrep -f bench_vllm.py > /dev/null && echo "still running" || echo "finished"
cp /tmp/bench_out/*.json /tmp/bench_out/*.log "${OUT:-/tmp}/" 2>/dev/null
tail -n 30 /tmp/bench_out/bench.log
