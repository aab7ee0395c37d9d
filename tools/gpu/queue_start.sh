#!/usr/bin/env bash
# On the GPU machine after install.sh: GPU jobs one after the other, detached, so that they outlive the
# call and the GPU never waits for the next one (the machine stays warm while calls follow). Each job
# logs to /tmp/bench_out/<job>.log and writes its results there; tools/gpu/bench_wait.sh collects them.
#
#   bash tools/gpu/queue_start.sh JOB [JOB ...]
#
#   tests                   every GPU test but vLLM's (kernels, dispatch, engines, trainer; 8 workers)
#   vllm-tests              the GPU tests against the real vLLM engine (tests/test_vllm_gpu.py)
#   "bench ARGS"            benchmarks/bench_vllm.py --profile gpu ARGS (vllm.json, modes_so_far.json)
#   "grpo ARGS"             benchmarks/bench_controller_gpu.py ARGS (controller_gpu.json)
#   "collapse P S ARGS"     tools/gpu/collapse_run.sh P S ARGS (the GPU collapse study: SFT, then P study processes)
#   "collapse-small P S ARGS"  the same on examples/collapse/chain_moe_small.yaml and chain_grpo_gpu_small.yaml
#                           (SFT in /tmp/collapse/sft_small unless one was unpacked there: batch 256, cosine lr,
#                           ended at held-out greedy accuracy 0.5;
#                           runs 10 s apart)
#   "ncu ARGS"              tools/gpu/ncu_grouped.sh ARGS (Nsight Compute of one grouped-kernel launch)
#   "floor ARGS"            tools/grouped_ws_floor.py ARGS (the grouped kernel against its stream and compute floors)
#
# A job that fails does not stop the ones after it; tests, vllm-tests, grpo and ncu are stopped after
# 15 minutes so that one that hangs does not hold up the queue.
set -euo pipefail
(( $# )) || { sed -n 2,21p "$0" >&2; exit 2; }
for job in "$@"; do
  case ${job%% *} in tests|vllm-tests|bench|grpo|collapse|collapse-small|ncu|floor) ;; *) echo "unknown job: $job" >&2; exit 2 ;; esac
done
# the smaller setting's SFT: batch 256 costs a step about what batch 64 does on the H200 (launch-bound); it
# ends at held-out greedy accuracy 0.5 (0.24 at step 250 and 0.99 at 500 when measured), where GRPO's rewards
# still vary
SMALL_SFT_ARGS="--batch 256 --lr 1e-3 --schedule cosine --warmup 100 --min-lr 1e-4 --eval-every 50 --eval-problems 50 --stop-at-accuracy 0.5"
rm -rf /tmp/bench_repo /tmp/bench_out && mkdir -p /tmp/bench_out
cp -r . /tmp/bench_repo
cd /tmp/bench_repo
script=/tmp/bench_out/queue.sh
{
  echo "cd /tmp/bench_repo; export PYTHONPATH=/tmp/site:/tmp/bench_repo/tools"
  for job in "$@"; do
    read -r name args <<< "$job"
    case $name in
      tests) echo "timeout -k 30 900 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --continue-on-collection-errors tests/ --ignore=tests/test_vllm_gpu.py > /tmp/bench_out/tests.log 2>&1" ;;
      vllm-tests) echo "timeout -k 30 900 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_vllm_gpu.py > /tmp/bench_out/vllm-tests.log 2>&1" ;;
      bench) echo "python3 benchmarks/bench_vllm.py --profile gpu --out /tmp/bench_out/vllm.json --results-dir /tmp/bench_out $args > /tmp/bench_out/bench.log 2>&1" ;;
      grpo) echo "timeout -k 30 900 python3 benchmarks/bench_controller_gpu.py --out /tmp/bench_out/controller_gpu.json $args > /tmp/bench_out/grpo.log 2>&1" ;;
      collapse) echo "bash tools/gpu/collapse_run.sh $args > /tmp/bench_out/collapse.log 2>&1" ;;
      collapse-small) echo "MODEL=examples/collapse/chain_moe_small.yaml CONFIG=examples/collapse/chain_grpo_gpu_small.yaml SFT=/tmp/collapse/sft_small SPACING=10 SFT_ARGS='$SMALL_SFT_ARGS' bash tools/gpu/collapse_run.sh $args > /tmp/bench_out/collapse.log 2>&1" ;;
      ncu) echo "OUT=/tmp/bench_out timeout -k 30 900 bash tools/gpu/ncu_grouped.sh $args > /tmp/bench_out/ncu.log 2>&1" ;;
      floor) echo "timeout -k 30 600 python3 tools/grouped_ws_floor.py --out /tmp/bench_out/grouped_ws_floor.json $args > /tmp/bench_out/floor.log 2>&1" ;;
    esac
    echo "echo \"$name exit \$? \$(date +%T)\" >> /tmp/bench_out/queue.log"
  done
} > "$script"
setsid nohup bash "$script" < /dev/null > /dev/null 2>&1 &
echo "started pid $! (jobs: $*)"
