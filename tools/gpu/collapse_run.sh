#!/usr/bin/env bash
# On the GPU machine after install.sh (bundle staged with tools/gpu/trainer_wheels.sh), in the foreground
# (tools/gpu/queue_start.sh "collapse P S ARGS" runs it detached): the GPU collapse study.
#   1. SFT of examples/collapse/chain_moe_model.yaml on the chain task (tools/sft.py) into
#      /tmp/collapse/sft, unless a finished one is there (log and metrics under /tmp/bench_out);
#   2. the grid: PROCESSES `benchmarks/study_precisions.py run --config examples/collapse/chain_grpo_gpu.yaml`
#      sharing it (each claims its runs by lock file), started a minute apart so that each vLLM engine
#      profiles its memory alone; runs under /tmp/collapse/runs, finished runs' records under
#      /tmp/bench_out/collapse_results.
#
#   bash tools/gpu/collapse_run.sh PROCESSES SFT_STEPS [study run arguments, e.g. --steps 300 --seeds 0 --modes bf16 naive-nvfp4]
set -euo pipefail
procs=${1:?usage: collapse_run.sh PROCESSES SFT_STEPS [study run arguments]}
sft_steps=${2:?usage: collapse_run.sh PROCESSES SFT_STEPS [study run arguments]}
shift 2
mkdir -p /tmp/bench_out /tmp/collapse
export PYTHONPATH=/tmp/site:$PWD/tools
if [[ ! -f /tmp/collapse/sft/checkpoint/model_config.json ]]; then
  python3 tools/sft.py --out /tmp/collapse/sft --model examples/collapse/chain_moe_model.yaml --task chain \
      --task-option min_steps=24 --task-option max_steps=40 --steps "$sft_steps" --batch 64 --lr 1e-3 --eval-every 500 \
      > /tmp/bench_out/sft.log 2>&1
  cp /tmp/collapse/sft/metrics.jsonl /tmp/bench_out/sft_metrics.jsonl
fi
for i in $(seq 1 "$procs"); do
  python3 benchmarks/study_precisions.py run model.checkpoint=/tmp/collapse/sft/checkpoint checkpoint.every=50 \
      --config examples/collapse/chain_grpo_gpu.yaml --out /tmp/collapse/runs \
      --results /tmp/bench_out/collapse_results "$@" > "/tmp/bench_out/study_$i.log" 2>&1 &
  if (( i < procs )); then sleep 60; fi
done
wait
