#!/usr/bin/env bash
# On the GPU machine after install.sh (bundle staged with tools/gpu/trainer_wheels.sh), in the foreground
# (tools/gpu/queue_start.sh "collapse P S ARGS" runs it detached): the GPU collapse study.
#   1. SFT of $MODEL on the chain task (tools/sft.py $SFT_ARGS) into $SFT, unless a finished one is there
#      (one unpacked there by tools/gpu/unpack.sh, or one of this machine's earlier calls); one that was
#      stopped before its last step starts again from its last save (tools/sft.py --init), as it does
#      from $SFT_INIT where that is set; log and metrics under /tmp/bench_out;
#   2. the grid: PROCESSES `benchmarks/study_precisions.py run --config $CONFIG` sharing it (each claims
#      its runs by lock file), started $SPACING seconds apart (60 by default: an engine whose KV cache is
#      profiled must start while no other engine sleeps or wakes; with rollout.vllm.gpu_kv_cache_gb set, as
#      chain_grpo_gpu_small.yaml does, a few seconds do); runs under /tmp/collapse/runs, finished runs'
#      records under /tmp/bench_out/collapse_results;
#   3. `study_precisions.py analyze` on each run's final checkpoint as soon as the run has finished, on the
#      CPU (the gap split into weight and activation error, the RAC sweep, on the chain task's held-out problems),
#      into /tmp/bench_out/collapse_results/analysis: the checkpoints stay on the machine, the analyses
#      come back; at the end `study_precisions.py report` (/tmp/bench_out/collapse_results.md, _curves.png).
#
#   [MODEL=... CONFIG=... SFT=... SPACING=... SFT_ARGS=... SFT_INIT=...] bash tools/gpu/collapse_run.sh PROCESSES
#       SFT_STEPS [study run arguments: options and key=value overrides, e.g. --steps 300 --seeds 0
#       --modes bf16 naive-nvfp4 grpo.prompts_per_step=32]
#   defaults: MODEL=examples/collapse/chain_moe_model.yaml CONFIG=examples/collapse/chain_grpo_gpu.yaml
#             SFT=/tmp/collapse/sft SPACING=60 SFT_ARGS="--batch 64 --lr 1e-3 --eval-every 500" SFT_INIT= (none)
#             BENCH_OUT=/tmp/bench_out (logs, records, analyses) RUNS=/tmp/collapse/runs (run directories)
set -euo pipefail
procs=${1:?usage: collapse_run.sh PROCESSES SFT_STEPS [study run arguments]}
sft_steps=${2:?usage: collapse_run.sh PROCESSES SFT_STEPS [study run arguments]}
shift 2
model=${MODEL:-examples/collapse/chain_moe_model.yaml}
config=${CONFIG:-examples/collapse/chain_grpo_gpu.yaml}
sft=${SFT:-/tmp/collapse/sft}
out=${BENCH_OUT:-/tmp/bench_out}
runs=${RUNS:-/tmp/collapse/runs}
spacing=${SPACING:-60}
read -r -a sft_args <<< "${SFT_ARGS:---batch 64 --lr 1e-3 --eval-every 500}"
init=${SFT_INIT:-}
mkdir -p "$out" "$runs"
export PYTHONPATH=/tmp/site:$PWD/tools
# finished: a manifest that says so (older ones: whose steps_done, where present, equals its steps)
finished=$(python3 -c 'import json, sys
try: m = json.load(open(sys.argv[1]))
except OSError: print(0); sys.exit()
print(int(m.get("finished", m.get("steps_done", m.get("steps")) == m.get("steps"))))' "$sft/checkpoint/manifest.json")
if [[ $finished != 1 ]]; then
  if [[ -z $init && -f $sft/checkpoint/metadata.json ]]; then
    init=$sft/checkpoint.start
    rm -rf "$init" && cp -r "$sft/checkpoint" "$init"  # the run replaces $sft whole as it saves
  fi
  python3 tools/sft.py --out "$sft" --model "$model" --task chain \
      --task-option min_steps=24 --task-option max_steps=40 --steps "$sft_steps" "${sft_args[@]}" \
      ${init:+--init "$init"} --save-every 250 > "$out/sft.log" 2>&1
  cp "$sft/metrics.jsonl" "$out/sft_metrics.jsonl"
fi
(( procs > 0 )) || exit 0
# the runs' key=value overrides go first, with this script's own: `study_precisions.py run` takes its
# positional overrides in one piece, before options such as --modes that take several values
overrides=() options=()
for arg in "$@"; do
  if [[ $arg == *=* && $arg != -* ]]; then overrides+=("$arg"); else options+=("$arg"); fi
done
pids=()
for i in $(seq 1 "$procs"); do
  python3 benchmarks/study_precisions.py run "model.checkpoint=$sft/checkpoint" checkpoint.every=50 \
      "${overrides[@]}" --config "$config" --out "$runs" \
      --results "$out/collapse_results" "${options[@]}" > "$out/study_$i.log" 2>&1 &
  pids+=($!)
  if (( i < procs )); then sleep "$spacing"; fi
done
# analyse each run as soon as its records are complete (the machine may go back before the last run ends)
attempted=" "
analyze_finished() {
  local record name todo=()
  for record in "$out"/collapse_results/*.metrics.jsonl.gz; do
    [[ -f $record ]] || continue
    name=$(basename "$record" .metrics.jsonl.gz)
    [[ $attempted == *" $name "* || -f $out/collapse_results/analysis/$name.json ]] || todo+=("$name")
  done
  (( ${#todo[@]} )) || return 0
  attempted+="${todo[*]} "  # a failed analysis is not tried again every round
  # on the CPU (fp32; about a minute a checkpoint of the small policy on 2 cores): the GPU stays with the runs
  CUDA_VISIBLE_DEVICES= python3 benchmarks/study_precisions.py analyze --out "$runs" --results "$out/collapse_results" \
      "${todo[@]}" >> "$out/analyze.log" 2>&1 || echo "analysis of ${todo[*]} failed (see analyze.log)" >&2
}
while kill -0 "${pids[@]}" 2> /dev/null; do  # true while any study process runs
  analyze_finished
  sleep 10
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
analyze_finished
# the grid's tables and curves, stamped with this machine: $out/collapse_results.md and _curves.png
if compgen -G "$out/collapse_results/*.metrics.jsonl.gz" > /dev/null; then
  python3 benchmarks/study_precisions.py report --results "$out/collapse_results" >> "$out/analyze.log" 2>&1 || status=1
fi
exit "$status"
