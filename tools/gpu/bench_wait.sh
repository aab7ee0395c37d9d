#!/usr/bin/env bash
# On the GPU machine: wait up to SECONDS for the detached tests, benchmark or study (suite_start.sh,
# bench_start.sh, collapse_start.sh), then copy their results and logs to $OUT.
set -uo pipefail
limit=${1:?usage: tools/gpu/bench_wait.sh SECONDS}
end=$((SECONDS + limit))
running() { pgrep -f "bench_vllm.py|pytest -q -m gpu|study_precisions.py|tools/sft.py" > /dev/null; }
while (( SECONDS < end )) && running; do sleep 5; done
running && echo "still running" || echo "finished"
cp /tmp/bench_out/*.json /tmp/bench_out/*.jsonl /tmp/bench_out/*.log "${OUT:-/tmp}/" 2>/dev/null
[[ -d /tmp/bench_out/collapse_results ]] && cp -r /tmp/bench_out/collapse_results "${OUT:-/tmp}/"
for run in /tmp/collapse/runs/*/; do  # the collapse study's runs so far
  [[ -f $run/metrics.jsonl ]] && cp "$run/metrics.jsonl" "${OUT:-/tmp}/partial_$(basename "$run").metrics.jsonl"
done
for log in /tmp/bench_out/test_*.log; do [[ -f $log ]] && { echo "== $log"; tail -n 4 "$log"; }; done
tail -n 20 /tmp/bench_out/bench.log 2>/dev/null
