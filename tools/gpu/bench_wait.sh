#!/usr/bin/env bash
# On the GPU machine: wait up to SECONDS for the jobs of tools/gpu/queue_start.sh, then put what they
# wrote so far into $OUT/bench_out.tgz (one file: a call brings back at most 8) with each collapse-study
# run's metrics, evaluations and profiled steps' tables so far, and print the queue's progress and the
# ends of the logs.
set -uo pipefail
limit=${1:?usage: tools/gpu/bench_wait.sh SECONDS}
end=$((SECONDS + limit))
running() { pgrep -f "bench_vllm.py|bench_controller_gpu.py|pytest -q -m gpu|study_precisions.py|tools/sft.py|ncu |grouped_ws_floor.py" > /dev/null; }
while (( SECONDS < end )) && running; do sleep 5; done
running && echo "still running" || echo "finished"
mkdir -p /tmp/bench_out/partial
for run in /tmp/collapse/runs/*/; do  # the collapse study's runs so far
  for records in metrics eval; do
    [[ -f $run/$records.jsonl ]] && cp "$run/$records.jsonl" "/tmp/bench_out/partial/$(basename "$run").$records.jsonl"
  done
  for table in "$run"/profile/step_*/*.txt; do  # profiled steps' tables (their traces stay on the machine)
    [[ -f $table ]] && cp "$table" "/tmp/bench_out/partial/$(basename "$run").$(basename "$(dirname "$table")").$(basename "$table")"
  done
done
tar -czf "${OUT:-/tmp}/bench_out.tgz" -C /tmp bench_out
cat /tmp/bench_out/queue.log 2>/dev/null
for log in /tmp/bench_out/*.log; do
  [[ -f $log && $log != */queue.log ]] && { echo "== $log"; tail -n 3 "$log" | cut -c1-300; }
done
