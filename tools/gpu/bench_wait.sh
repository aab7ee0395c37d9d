#!/usr/bin/env bash
# On the GPU machine: wait up to SECONDS for the detached tests and benchmark (suite_start.sh or
# bench_start.sh), then copy their results and logs to $OUT.
set -uo pipefail
limit=${1:?usage: tools/gpu/bench_wait.sh SECONDS}
end=$((SECONDS + limit))
running() { pgrep -f "bench_vllm.py|pytest -q -m gpu" > /dev/null; }
while (( SECONDS < end )) && running; do sleep 5; done
running && echo "still running" || echo "finished"
cp /tmp/bench_out/*.json /tmp/bench_out/*.log "${OUT:-/tmp}/" 2>/dev/null
for log in /tmp/bench_out/test_*.log; do [[ -f $log ]] && { echo "== $log"; tail -n 4 "$log"; }; done
tail -n 20 /tmp/bench_out/bench.log 2>/dev/null
